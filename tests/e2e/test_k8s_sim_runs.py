"""The k8s/ manifests' own pods, run by a stand-in kubelet and Job controller
(tests/harness/kubesim.py): the CPU variant's rendezvous Deployment and Indexed Job, with
the manifests' commands, arguments and environment, through pod loss, scale-up, the
loss of the rendezvous pod, a drain, completion and a late pod; a recreated Job waits
for its predecessor's last checkpoint; pods with node-local run directories (the
object storage component) refuse a job of two nodes without checkpoint.remote (with it,
a two-pod job through a pod's replacement: tests/e2e/test_object_storage_runs.py). A
broken config: tests/unit/test_k8s_sim.py.

The constant schedule (an override) lets a run's length be decided as it goes: the
last stage finishes 20 steps after the drain, and the uninterrupted reference runs
that many steps with the same learning rates."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

from tests.harness.kubesim import JOB, Cluster, kustomized
from tests.harness.multinode import Process, first
from tests.harness.runs import ROOT, limit, read_metrics, slow_state_writes

# The CPU variant's config, shortened: a tiny model, many quick steps.
SHORT = ["model.depth=1", "model.width=32", "model.heads=4", "model.context_length=32",
         "data.max_bytes=200000", "data.num_workers=0", "schedule.name=constant",
         "schedule.warmup_steps=2", "train.eval_every_steps=0",
         "train.eval_batches=1", "logging.every_steps=1", "logging.progress=plain",
         "checkpoint.every_steps=20"]
STEP = r"\]:step \d+/"


def runs(sim: Cluster):
    return sim.work / "pvc" / "train-runs" / "train-demo"


def steps_once(sim: Cluster) -> dict[int, float]:
    rows = [r for r in read_metrics(runs(sim)) if "loss" in r]
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, len(steps) + 1)), "every step exactly once"
    return {r["step"]: r["loss"] for r in rows}


def start(sim: Cluster, steps: int, indices=(0, 1)) -> tuple[Process, list[Process]]:
    store = sim.start_deployment("train-rendezvous")
    store.wait_for(r"listening on", 60)
    pods = [sim.start_index(JOB, i, [*SHORT, f"train.max_steps={steps}"]) for i in indices]
    return store, pods


def test_the_job_through_pod_loss_scale_up_store_loss_and_a_drain(sim, tmp_path):
    """One job's life, as a cluster would live it; each stage waits for the last."""
    big = [*SHORT, "train.max_steps=100000"]
    _, pods = start(sim, 100000)
    main = first(pods, r"world size 2(.|\n)*\]:step 30/")
    # 1. a worker pod's node vanishes (power loss: no FIN, no RST; with no network per pod
    #    here, the pod is killed): the other continues alone; the node's pods are evicted
    #    as disrupted, which the Job ignores, and it recreates the index
    lost = pods[1] if main is pods[0] else pods[0]
    index = 1 if lost is pods[1] else 0
    if sim.net is not None:
        sim.vanish(lost)
        main.wait_for(r"left the job \(.*its host is down or cut off\)", 120)
    lost.kill()
    assert sim.judge(JOB, 137, disrupted=True) == "Ignore"
    first([main], r"resumed from .*now 1\)(.|\n)*" + STEP)
    back = sim.start_index(JOB, index, big)
    first([main, back], r"now 2\)(.|\n)*" + STEP)
    assert "left: " in main.text() and "joined: " in main.text()  # a line per round
    # 2. scale-up: completions and parallelism 2 -> 3, index 2 joins
    third = sim.start_index(JOB, 2, big)
    first([main, back, third], r"now 3\)(.|\n)*" + STEP)
    pods = [main, back, third]
    # 3. the rendezvous pod is lost; its Deployment recreates it; the workers rejoin
    sim_store = next(p for p in sim.pods if p.name.startswith("train-rendezvous"))
    sim_store.kill()
    for p in pods:
        p.wait_for(r"is unreachable", 90)
    sim.start_deployment("train-rendezvous").wait_for(r"listening on", 60)
    for p in pods:
        p.wait_for(r"is back: joining the job again", 90)
    first(pods, r"is back(.|\n)*resumed from .*now 3\)(.|\n)*" + STEP)
    # 4. a drain: SIGTERM to every pod -> one coherent checkpoint, exit 143 each
    for p in pods:
        p.signal(signal.SIGTERM)
    assert [p.wait(120) for p in pods] == [143, 143, 143]
    assert sim.judge(JOB, 143, disrupted=True) == "Ignore"  # a drain is no failure
    text = "".join(p.text() for p in pods)
    assert "frame #" not in text and "SignalException" not in text  # one line each
    assert "stopped by a signal to a worker" not in text  # the store loss said as such
    latest = (runs(sim) / "checkpoints" / "latest").read_text().strip()
    drained = int(latest.split("-")[1])
    # 5. the pods come back (the Job at 2 again) and finish from that checkpoint
    steps = drained + 20
    pods = [sim.start_index(JOB, i, [*SHORT, f"train.max_steps={steps}"]) for i in (0, 1)]
    assert [p.wait(300) for p in pods] == [0, 0]  # every index succeeded: the Job completes
    assert f"resumed from {runs(sim) / 'checkpoints' / latest}" in "".join(p.text()
                                                                         for p in pods)
    got = steps_once(sim)
    assert max(got) == steps
    # 6. a pod started after the run finished: nothing to do, exit 0 at once
    late = sim.start_index(JOB, 1, [*SHORT, f"train.max_steps={steps}"])
    assert late.wait(60) == 0 and f"finished at step {steps}" in late.text()
    assert "launcher.torchrun" not in late.text()  # nothing was started
    # The trajectory of an uninterrupted run (one process, same config and steps):
    # same data order and global batch at world sizes 2 -> 1 -> 2 -> 3 -> 2, so the same
    # losses up to floating-point reduction order. Stated tolerance: 3 % over the last
    # 20 steps.
    cfg = sim.configmap("train-config") / "config.yaml"
    ref = subprocess.run([sys.executable, str(ROOT / "entrypoint.py"), "train", str(cfg),
                          *SHORT, f"train.max_steps={steps}", f"output.dir={tmp_path / 'ref'}"],
                         cwd=tmp_path, env=sim.base_env, capture_output=True, text=True,
                         timeout=limit(600))
    assert ref.returncode == 0, ref.stderr[-2000:]
    want = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "ref" / "train-demo")
            if "loss" in r}
    tail = range(steps - 19, steps + 1)
    mean = lambda d: sum(d[s] for s in tail) / len(tail)  # noqa: E731
    assert abs(mean(got) - mean(want)) < 0.03 * mean(want)


# The old pod's stop checkpoint takes 15 s more to write (a slow shared volume).


def test_a_recreated_job_waits_for_its_predecessors_last_checkpoint(sim, tmp_path):
    """`kubectl delete job` + `apply` while the old pod still writes its SIGTERM
    checkpoint: the new Job's pod (a new uid, so another job) waits for the old lease,
    then resumes from that checkpoint. Never exit 3, which would fail the new Job."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(slow_state_writes(15))
    store = sim.start_deployment("train-rendezvous")
    store.wait_for(r"listening on", 60)
    old = sim.start_index(JOB, 0, [*SHORT, "train.max_steps=100000",
                                   "checkpoint.every_steps=0"],
                          env={"PYTHONPATH": str(tmp_path / "site")})
    first([old], r"\]:step 10/")
    old.signal(signal.SIGTERM)
    first([old], r"received SIGTERM: stopping with a checkpoint")  # it writes it now
    sim.recreate_job()
    new = sim.start_index(JOB, 0, [*SHORT, "train.max_steps=40"])
    assert old.wait(120) == 143 and sim.judge(JOB, 143, disrupted=True) == "Ignore"
    code = new.wait(300)
    assert code == 0 and sim.judge(JOB, code) == "Succeeded", new.text()[-3000:]
    assert "waiting up to" in new.text() and "for the run directory" in new.text()
    assert "resumed from" in new.text()


def test_pods_with_node_local_run_directories_stop_a_multi_node_job_naming_them(tmp_path):
    """k8s/kustomize/objectstore gives each pod its run directory on its node: two pods of
    one job would each hold part of every checkpoint. Without checkpoint.remote (which
    would seal the parts in the store) both stop before step 1 in one line (exit 3: the
    Job fails at once, no retry can help)."""
    folder = kustomized(tmp_path, ["../cpu"], ["../objectstore"])
    sim = Cluster(folder, tmp_path, network=False, secrets={"train-s3": {}})
    try:
        store = sim.start_deployment("train-rendezvous")
        store.wait_for(r"listening on", 60)
        pods = [sim.start_index(JOB, i, [*SHORT, "train.max_steps=50"],
                                env={"TRAIN_NNODES": "2"}) for i in (0, 1)]
        codes = [p.wait(limit(300)) for p in pods]
    finally:
        sim.close()
    assert codes == [3, 3], "\n=====\n".join(p.text()[-5000:] for p in pods)
    assert sim.judge(JOB, 3) == "FailJob"
    for p in pods:
        assert "is not shared by the job's nodes" in p.text() and "Traceback" not in p.text()
        assert not re.search(STEP, p.text())  # nothing was trained
