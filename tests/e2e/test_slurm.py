"""The launcher under a real SLURM cluster (tests/harness/slurmcluster.py: slurmctld and two
slurmd, each node a host of its own): ``srun`` in both layouts trains as the same world
size does on one node; the shipped sbatch template runs; ``scancel`` stops with one
checkpoint and a resubmission resumes; the requeue signal checkpoints, requeues and the
job's next incarnation finishes, every step trained once; a node whose tasks are
killed ends the job promptly, naming it; a multi-node batch script without srun is one
line, exit 2.

Training runs a small MLP; the runs that must be stopped mid-way use the same model
with a pause in its forward pass (``slowmlp``, written into the work folder), which
changes no number, so every run is compared with one uninterrupted reference run of
world size 2 on this host. A run that a test stops holds after its first checkpoint
until the test has seen the stop arrive (:func:`held`), so a loaded machine that delays
the signal cannot let the run finish first. Timeouts are generous bounds for a loaded
2-core machine; the times printed are the measurements.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import cgroups
from tests.harness.procs import cmdline, environ, pids
from tests.harness.runs import (
    ENTRY,
    NO_GPU,
    ROOT,
    TINY_MLP,
    clean_env,
    limit,
    losses,
    merge,
    read_metrics,
    write_config,
)
from tests.harness.slurmcluster import SlurmCluster, wait_for_text

STEPS = 60
NO_GPUS = "--gpus-per-node=0"  # docs/slurm.md: the templates on a cluster without GPU GRES
HOLD_AFTER = 12  # training steps before a held run waits (its first checkpoint is step 10)
SLOW_MODEL = '''
import os
import time
import torch

class Pause(torch.nn.Module):
    """Sleeps in every forward; with ``hold``, from training step ``after`` on it also
    waits while that file exists (a signal handler still runs)."""
    def __init__(self, seconds, hold=None, after=0):
        super().__init__()
        self.seconds, self.hold, self.after, self.steps = seconds, hold, after, 0

    def forward(self, x):
        time.sleep(self.seconds)
        if self.training:
            self.steps += 1
            deadline = time.monotonic() + 900
            while self.hold and self.steps > self.after and os.path.exists(self.hold) \\
                    and time.monotonic() < deadline:
                time.sleep(0.05)
        return x

def build(inputs, outputs, width, seconds, hold=None, after=0):
    return torch.nn.Sequential(torch.nn.Linear(inputs, width), torch.nn.ReLU(),
                               Pause(seconds, hold, after), torch.nn.Linear(width, outputs))
'''


@pytest.fixture(scope="module")
def cluster(slurm_cluster):
    (slurm_cluster.work / "slowmlp.py").write_text(SLOW_MODEL)
    return slurm_cluster


def config(work: Path, name: str, pause_s: float = 0.0, hold: Path | None = None) -> Path:
    """``hold``: a file the run waits on after HOLD_AFTER steps while it exists."""
    args = {"inputs": 16, "outputs": 4, "width": 32, "seconds": pause_s}
    if hold is not None:
        hold.touch()
        args.update(hold=str(hold), after=HOLD_AFTER)
    tree = merge(TINY_MLP, {
        "run": {"name": name}, "output": {"dir": str(work / "runs")},
        "model": {"kind": "custom", "factory": "slowmlp:build", "args": args},
        "train": {"max_steps": STEPS, "eval_every_steps": 0},
        "checkpoint": {"every_steps": 10}})
    return write_config(work / f"{name}.yaml", tree)


def held(work: Path, name: str) -> Path:
    return work / f"{name}.hold"


def release(out: Path, hold: Path, after: str = "received SIGTERM") -> None:
    """Once the run's output shows ``after`` (the stop reached its workers), let it go on."""
    wait_for_text(out, after, 120)
    hold.unlink()


def task_env() -> dict:
    """What srun passes on to the tasks: no GPU, no launch variables of this host."""
    return {**clean_env(), **NO_GPU, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def reference(cluster) -> dict[int, float]:
    """An uninterrupted run of world size 2 on this host, without SLURM."""
    path = config(cluster.work, "reference")
    done = subprocess.run([sys.executable, ENTRY, "train", str(path),
                           "distributed.nproc_per_node=2"], cwd=cluster.work, env=task_env(),
                          capture_output=True, text=True, timeout=limit(600))
    assert done.returncode == 0, done.stderr[-3000:]
    return losses(cluster.work / "runs" / "reference")


def train_step(*srun_args: str, cfg: Path) -> list[str]:
    return ["srun", "--label", *srun_args, sys.executable, ENTRY, "train", str(cfg)]


def assert_same_losses(got: dict[int, float], want: dict[int, float], rel: float = 1e-5):
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step, value in want.items():
        assert got[step] == pytest.approx(value, rel=rel), f"step {step}"


def steps_logged(run_dir: Path) -> list[int]:
    return [row["step"] for row in read_metrics(run_dir) if "loss" in row]


def batch_script(cluster: SlurmCluster, name: str, body: str, *sbatch: str) -> Path:
    script = cluster.work / f"{name}.sbatch"
    lines = [f"#SBATCH {s}" for s in sbatch]
    script.write_text("#!/bin/bash\n" + "\n".join(lines) + f"\n#SBATCH -o {name}.out\n"
                      "#SBATCH --open-mode=append\nset -euo pipefail\n" + body + "\n")
    return script


def test_one_task_per_node_trains_as_the_same_world_size_on_one_node(cluster, reference):
    cfg = config(cluster.work, "per-node")
    done = cluster.run(train_step("-N2", "--ntasks-per-node=1", cfg=cfg), env=task_env(),
                       timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "SLURM step" in done.stderr and "one task per node: 2 nodes" in done.stderr
    assert "this is node 1 (node2)" in done.stderr
    assert_same_losses(losses(cluster.work / "runs" / "per-node"), reference, rel=1e-6)


def test_one_task_per_gpu_is_one_worker_per_task(cluster, reference):
    """Four tasks on two nodes: world size 4, the same losses (the data order and the
    trajectory do not depend on the world size, up to reduction order)."""
    cfg = config(cluster.work, "per-task")
    done = cluster.run(train_step("-N2", "--ntasks-per-node=2", cfg=cfg), env=task_env(),
                       timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "one task per GPU: 4 tasks on 2 node(s)" in done.stderr
    assert "world size 4" in done.stdout + done.stderr
    assert_same_losses(losses(cluster.work / "runs" / "per-task"), reference)


def template(cluster: SlurmCluster, name: str, shipped: str = "train.sbatch") -> Path:
    """A shipped template of slurm/, for this cluster: 1 CPU per task, its output here.
    It still asks for GPUs: submit it with NO_GPUS, as docs/slurm.md says for a cluster
    without GPU GRES."""
    text = (ROOT / "slurm" / shipped).read_text()
    assert "\n#SBATCH --gpus-per-node=8 " in text
    text = text.replace("--cpus-per-task=32", "--cpus-per-task=1")
    text = text.replace("--output=%x-%j.out", f"--output={name}.out")
    assert "#SBATCH --requeue" in text and "#SBATCH --signal=" in text
    script = cluster.work / f"{name}.sbatch"
    script.write_text(text)
    return script


def test_the_template_requeues_itself_on_its_signal_and_finishes(cluster, reference):
    """USR1 (what `#SBATCH --signal=USR1@300` sends before the time limit, to every
    process of the step): one checkpoint, `scontrol requeue` by task 0, and the next
    incarnation resumes from it and finishes; every step trained once."""
    name = "requeued"
    cfg = config(cluster.work, name, pause_s=0.1, hold=held(cluster.work, name))
    env = {**task_env(), "REPO": str(ROOT), "RUNS": str(cluster.work / "runs")}
    job = cluster.sbatch(template(cluster, name), NO_GPUS, env=env,
                         script_args=(str(cfg),))
    out = cluster.work / f"{name}.out"
    wait_for_text(out, "checkpoint saved", 300)
    signalled = time.monotonic()
    cluster.scancel(job, signal="USR1")
    release(out, held(cluster.work, name))
    text = wait_for_text(out, "requeueing the job", 120)
    assert "stopped by SIGUSR1" in text
    resumed = wait_for_text(out, "resumed from", 300)
    first_step = time.monotonic() - signalled
    assert cluster.wait_job(job, 600) == "COMPLETED", cluster.job(job)
    assert cluster.job(job).get("Restarts") == "1"
    run = cluster.work / "runs" / name
    assert steps_logged(run) == list(range(1, STEPS + 1)), "each step trained once"
    assert_same_losses(losses(run), reference, rel=1e-6)
    assert resumed.count("requeueing the job") == 1
    # the earlier incarnation's lease is taken, not waited for; only a process of it
    # still exiting on this node (SLURM counts the job ended before every process is
    # gone, which takes a while on a busy machine) is waited for
    assert "an earlier incarnation of this job" in resumed, resumed[-3000:]
    waits = [line for line in resumed.splitlines() if "waiting up to" in line]
    assert all("a process of it on this host is still running" in w for w in waits), waits
    print(f"requeue signal -> the next incarnation resumed: {first_step:.1f} s")


# `apptainer exec FLAGS --bind SRC:DST ... IMAGE CMD...` as far as the template's flow
# needs it: CMD runs with this checkout at /app and SRC at DST, and without SLURM's
# commands on its PATH, as inside a container.
FAKE_APPTAINER = """#!/bin/bash
set -euo pipefail
[ "$1" = exec ] && shift
src= dst=
while [ $# -gt 0 ]; do
    case $1 in
        --bind) src=${2%%:*}; dst=${2#*:}; shift 2 ;;
        --pwd) shift 2 ;;
        --*) shift ;;
        *) shift; break ;;  # the image
    esac
done
args=() app=/app/
for a in "$@"; do
    a=${a/#python3/%(python)s}; a=${a//$app/%(root)s/}; a=${a//$dst/$src}; args+=("$a")
done
PATH=/nonexistent exec "${args[@]}"
"""


def test_the_container_template_requeues_from_its_batch_shell(cluster, reference):
    """slurm/train-apptainer.sbatch (apptainer faked, see above): `--signal=B:USR1`
    signals the batch shell only, which passes it on to the step and, once the run
    stopped with its checkpoint, requeues the job itself (no scontrol in a container)."""
    name = "container"
    bin_dir = cluster.work / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "apptainer"
    fake.write_text(FAKE_APPTAINER % {"python": sys.executable, "root": ROOT})
    fake.chmod(0o755)
    cfg = config(cluster.work, name, pause_s=0.1, hold=held(cluster.work, name))
    env = {**task_env(), "PATH": f"{bin_dir}:{os.environ['PATH']}", "IMAGE": "train.sif",
           "RUNS": str(cluster.work / "runs")}
    script = template(cluster, name, "train-apptainer.sbatch")
    job = cluster.sbatch(script, NO_GPUS, env=env, script_args=(str(cfg),))
    out = cluster.work / f"{name}.out"
    wait_for_text(out, "checkpoint saved", 300)
    cluster.scancel(job, signal="USR1", batch=True)  # what B:USR1@N does at its time
    release(out, held(cluster.work, name))
    wait_for_text(out, "resumed from", 300)
    assert cluster.wait_job(job, 600) == "COMPLETED", out.read_text()[-3000:]
    text = out.read_text()
    assert cluster.job(job).get("Restarts") == "1"
    assert "stopped by SIGUSR1" in text and "note: no scontrol here" in text
    run = cluster.work / "runs" / name
    assert steps_logged(run) == list(range(1, STEPS + 1))
    assert_same_losses(losses(run), reference, rel=1e-6)


def training_job(cluster: SlurmCluster, name: str) -> tuple[Path, int, Path]:
    """A two-node job (one task per node) of the paused model, once it has written its
    first checkpoint, held after it (:func:`release`): (its script, its id, its output)."""
    cfg = config(cluster.work, name, pause_s=0.1, hold=held(cluster.work, name))
    script = batch_script(cluster, name, f"srun {sys.executable} {ENTRY} train {cfg}",
                          "-N2", "--ntasks-per-node=1")
    job = cluster.sbatch(script, env=task_env())
    out = cluster.work / f"{name}.out"
    wait_for_text(out, "checkpoint saved", 300)
    return script, job, out


def test_scancel_stops_with_one_checkpoint_and_a_resubmission_resumes(cluster, reference):
    name = "cancelled"
    script, job, out = training_job(cluster, name)
    cancelled = time.monotonic()
    cluster.scancel(job)
    release(out, held(cluster.work, name))
    wait_for_text(out, "task 1: Exited with exit code 143", 120)
    wait_for_text(out, "task 0: Exited with exit code 143", 60)
    stopped_s = time.monotonic() - cancelled
    assert cluster.wait_job(job, 120) == "CANCELLED"
    text = out.read_text()
    assert text.count("stopped by SIGTERM; rerun the same command to resume from the last "
                      "checkpoint") == 2, text[-3000:]
    assert "training failed" not in text
    run = cluster.work / "runs" / name
    saved = (run / "checkpoints" / "latest").read_text().strip()
    stopped_at = int(saved.split("-")[1])
    assert 0 < stopped_at < STEPS
    again = cluster.sbatch(script, env=task_env())
    assert cluster.wait_job(again, 600) == "COMPLETED", out.read_text()[-3000:]
    assert f"resumed from {run / 'checkpoints' / saved}" in out.read_text() or \
        re.search(rf"resumed from .*{saved}", out.read_text())
    assert_same_losses(losses(run), reference, rel=1e-6)
    assert steps_logged(run) == list(range(1, STEPS + 1))
    print(f"scancel -> every task stopped with its checkpoint: {stopped_s:.1f} s")


STARVED = 0.02  # of one CPU: what a node far busier than its cores leaves a process


def test_a_stop_on_starved_nodes_ends_with_the_launchers_own_code_inside_killwait(cluster):
    """scancel while each node's launcher and torchrun are held to 2 % of a CPU (a cgroup
    quota; the workers write their stop checkpoint at their own pace): on each node the
    launcher's verdict, then its own exit 143, inside the cluster's KillWait (30 s), not
    SIGKILLed at its end. What follows the checkpoint needs little CPU: torchrun's
    interpreter teardown alone, 0.6 s of CPU, took 30 s there."""
    why = cgroups.available()
    if why:
        pytest.skip(f"no CPU quota here: {why}")
    name = "starved"
    _, job, out = training_job(cluster, name)
    quotas = [cgroups.CpuLimit(STARVED) for _ in cluster.hosts]
    try:
        for quota, host in zip(quotas, cluster.hosts, strict=True):
            argvs = {pid: cmdline(pid).split() for pid in processes_of(job, host.name)}
            tail = [pid for pid, argv in argvs.items() if argv[:1] == [sys.executable] and
                    (argv[1:2] == [ENTRY] or argv[1:3] == ["-m", "launcher.torchrun"])]
            assert len(tail) == 2, f"{host.name}: the launcher and torchrun: {argvs}"
            for pid in tail:
                quota.add(pid)
        cluster.scancel(job)
        release(out, held(cluster.work, name))
        ended = [wait_for_text(out, f"task {task}: ", 120) for task in (0, 1)][-1]
    finally:
        for quota in quotas:
            quota.close()
    lines = ended.splitlines()
    tasks = [line for line in lines if re.search(r"node\d: task \d: ", line)]
    assert sorted(line.split("task ")[1] for line in tasks) == \
        ["0: Exited with exit code 143", "1: Exited with exit code 143"], ended[-3000:]
    verdicts = [i for i, line in enumerate(lines) if line == "stopped by SIGTERM; rerun the "
                "same command to resume from the last checkpoint"]
    saved = [i for i, line in enumerate(lines) if "checkpoint saved" in line]
    assert len(verdicts) == 2 and saved[-1] < verdicts[0], ended[-3000:]
    assert verdicts[0] < min(lines.index(line) for line in tasks), ended[-3000:]  # said, exited
    assert "Killed" not in ended and "Timed out" not in ended, ended[-3000:]


def processes_of(job: int, node: str) -> list[int]:
    """This job's processes on ``node`` (the task's launcher and everything it started),
    found by the variables slurm gave them."""
    found = []
    for pid in pids():
        env = environ(pid)
        if "python" in cmdline(pid) and env.get("SLURM_JOB_ID") == str(job) and \
                env.get("SLURMD_NODENAME") == node:
            found.append(pid)
    return found


def test_a_node_whose_tasks_are_killed_ends_the_job_naming_it(cluster, reference):
    name = "lost-node"
    script, job, out = training_job(cluster, name)
    victims = processes_of(job, "node2")
    assert victims, "the task on node2 runs"
    killed = time.monotonic()
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    held(cluster.work, name).unlink()  # node1 trains on into the lost node
    state = cluster.wait_job(job, 120)
    noticed_s = time.monotonic() - killed
    text = out.read_text()
    assert state == "FAILED", text[-3000:]
    failed = [line for line in text.splitlines() if "error: training failed" in line]
    # a killed process closes its connections: gloo names its address at once; a node
    # that goes silent instead is named by the heartbeat (tests/e2e/test_vanish.py)
    assert failed and any("lost node 1 (" in line or "198.18.0.3" in line for line in failed), \
        text[-3000:]
    again = cluster.sbatch(script, env=task_env())
    assert cluster.wait_job(again, 600) == "COMPLETED", out.read_text()[-3000:]
    assert "resumed from" in out.read_text()
    assert_same_losses(losses(cluster.work / "runs" / name), reference, rel=1e-6)
    print(f"a node's tasks killed -> the other node named it and stopped: {noticed_s:.1f} s")


def test_a_multi_node_batch_script_without_srun_is_one_line(cluster):
    name = "no-srun"
    cfg = config(cluster.work, name)
    script = batch_script(cluster, name, f"{sys.executable} {ENTRY} train {cfg}", "-N2")
    job = cluster.sbatch(script, env=task_env())
    assert cluster.wait_job(job, 300) == "FAILED"
    assert cluster.job(job).get("ExitCode") == "2:0"
    text = (cluster.work / f"{name}.out").read_text()
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert errors == ["error: environment: SLURM_STEP_ID: not set: this is the batch script "
                      "of a job on 2 nodes, which runs on the first node only; start the "
                      "launcher with srun (one task per node, or one per GPU)"]
    assert not (cluster.work / "runs" / name).exists()


def test_without_requeue_the_signal_still_stops_with_a_checkpoint_and_says_so(cluster):
    name = "not-requeueable"
    cfg = config(cluster.work, name, pause_s=0.1, hold=held(cluster.work, name))
    script = batch_script(cluster, name, f"srun {sys.executable} {ENTRY} train {cfg}",
                          "-N2", "--ntasks-per-node=1", "--no-requeue")
    job = cluster.sbatch(script, env=task_env())
    out = cluster.work / f"{name}.out"
    wait_for_text(out, "checkpoint saved", 300)
    cluster.scancel(job, signal="USR1")
    release(out, held(cluster.work, name))
    assert cluster.wait_job(job, 180) == "FAILED"
    assert cluster.job(job).get("ExitCode") == "143:0" and cluster.job(job)["Restarts"] == "0"
    text = out.read_text()
    warned = [line for line in text.splitlines() if "was not requeued" in line]
    assert len(warned) == 1 and "scontrol requeue" in warned[0], text[-3000:]
    assert "sbatch --requeue" in warned[0]
    assert (cluster.work / "runs" / name / "checkpoints" / "latest").exists()


# Last in this file: the cluster's hosts keep the nameserver that never answers.
DNS_STARTS = int(os.environ.get("TEST_SLURM_DNS_STARTS", "2"))  # 10 when measuring


def test_a_nameserver_that_never_answers_causes_no_false_node_loss(cluster):
    """What air-gapped and HPC nodes often have: lookups that hang. One task per node,
    started again and again: every start trains to its end, no node is called lost."""
    for host in cluster.hosts:
        cluster.net.hanging_nameserver(host)
    for start in range(DNS_STARTS):
        cfg = write_config(cluster.work / f"dns{start}.yaml", merge(TINY_MLP, {
            "run": {"name": f"dns{start}"}, "output": {"dir": str(cluster.work / "runs")},
            "train": {"max_steps": 4, "eval_every_steps": 0}}))
        done = cluster.run(train_step("-N2", "--ntasks-per-node=1", cfg=cfg),
                           env=task_env(), timeout=600)
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"start {start}: {output[-3000:]}"
        assert "lost node" not in output, f"start {start}: {output[-3000:]}"
        assert "heartbeat: node 1 (" in output, output[-3000:]
    print(f"{DNS_STARTS} SLURM starts of 2 nodes behind a nameserver that hangs: no false loss")
