"""Replica groups on Kubernetes, played by the stand-in kubelet and Job controller
(tests/harness/kubesim.py) from what ``kubectl kustomize`` renders for an overlay of
k8s/kustomize/cpu with the k8s/kustomize/replicas component: the Lighthouse's
Deployment, and the Indexed Job's three pods (2 replica groups + 1 spare), each pod a
host of its own (a network namespace) where this machine allows.

One job's life: the pod of group 1 is killed (its node's processes all gone); the
other pods train on in the same processes, the spare takes group 1's slot; the Job
controller counts the failure against the index and recreates it, and the new pod
resumes from the last checkpoint, heals from a live group and trains again in its slot.
Group 0's node then freezes (every process of its pod stopped: launcher, torchrun,
worker): the others commit steps without it in the same processes; continued, it heals
from a live group and trains its slot again, in its own processes.
With a network per pod, the spare's link is then cut (no FIN, no RST): the others wait
out the cross-group all-reduce once and train on; its pod is replaced and joins again.
The Lighthouse's pod is lost: each pod says so in one line and stops its group; once the
Deployment's replacement answers at the same Service, every group starts again from the
last checkpoint, in the same pods (after ``distributed.max_restarts`` such losses a pod
exits 1: tests/e2e/test_replica_launch.py).
Then a drain (SIGTERM to every pod) stops every group at one step with one checkpoint,
exit 143 each. The ledger lists every sample of steps 1..S exactly once, and the
weights at S are those of a fault-free run of S steps on one machine.
"""

from __future__ import annotations

import importlib.util
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from launcher.detection.torchft_tools import lighthouse_binary
from tests.harness.kubesim import JOB, Cluster, kustomized
from tests.harness.multinode import Process
from tests.harness.procs import cmdline, environ, pids
from tests.harness.runs import ENTRY, clean_env, limit, wait_for
from train.observe.ledger import check_exactly_once, read

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchft") is None or lighthouse_binary() is None,
    reason="needs torchft and its torchft_lighthouse (make ft)")

# The tiny mlp of tests/e2e/test_replica_runs.py; a constant schedule, so that the run
# stopped at step S trains what a run of S steps does.
CONFIG = {"run": {"name": "train-demo"}, "model": {"kind": "mlp"},
          "data": {"kind": "synthetic"},
          "train": {"max_steps": 100000, "global_batch_size": 16},
          "schedule": {"name": "constant", "warmup_steps": 0},
          "logging": {"every_steps": 100}, "checkpoint": {"every_steps": 100},
          "distributed": {"replica_timeout_s": 5, "max_restarts": 3}}


def workers(sim: Cluster) -> dict[int, int]:
    """Replica group -> the (host) pid of its worker, among this Job's pods."""
    found = {}
    for pid in pids():
        env = environ(pid)
        if env.get("TRAIN_RDZV_ID") == sim.job_uid and "REPLICA_GROUP_ID" in env and \
                "train.worker" in cmdline(pid):
            found[int(env["REPLICA_GROUP_ID"])] = pid
    return found


def ledger(sim: Cluster) -> list:
    path = sim.work / "pvc" / "train-runs" / "train-demo" / "ledger.jsonl"
    return read(path) if path.exists() else []


def slots_after(sim: Cluster, step: int, replicas: list[int]) -> bool:
    return any(e.step > step and e.replicas == replicas for e in ledger(sim))


def replaced(sim: Cluster, pods: list, index: int, args: list[str]) -> int:
    """The pod of ``index`` gone (its failure counted against the index), the Job
    controller's new one started; the last committed step when it was lost."""
    pods[index].kill()
    assert sim.judge(JOB, 137) == "Count"  # backoffLimitPerIndex: 3 per index
    lost_at = ledger(sim)[-1].step
    pods[index] = sim.start_index(JOB, index, args)
    return lost_at


def healed(pod: Process, group: int) -> int:
    return pod.text().count(f"replica group {group} healed from a live peer")


# A freeze past every clock that could give up on the frozen pod: the cross-group
# all-reduce (distributed.replica_timeout_s, 5 s here), the Lighthouse's heartbeat (2 s),
# and the keep-alive of the group's own torchrun rendezvous (torch's 5 s x 3), which
# stops too and finds its own heartbeat stale when it runs again.
FROZEN_S = 16


def frozen_and_thawed(sim: Cluster, pods: list, group: int) -> None:
    """Every process of ``group``'s pod stopped: the other groups commit steps without
    it (the spare in its slot) in the same processes; continued, it heals from a live
    group and trains its slot again, in its own processes."""
    before, heals = workers(sim), healed(pods[group], group)
    others = sorted(set(before) - {group})
    stopped, frozen_at = sim.freeze(pods[group]), time.monotonic()
    try:
        at = ledger(sim)[-1].step
        wait_for(lambda: len([e for e in ledger(sim) if e.step > at and
                              sorted(e.replicas) == others]) >= 10,
                 120, f"10 steps without group {group}")
        time.sleep(max(0.0, FROZEN_S - (time.monotonic() - frozen_at)))
    finally:
        sim.thaw(stopped)
    thawed = ledger(sim)[-1].step
    wait_for(lambda: slots_after(sim, thawed, [0, 1]), 120, f"group {group} back")
    wait_for(lambda: healed(pods[group], group) > heals, 30, f"group {group} healed")
    assert workers(sim) == before, (before, workers(sim))
    assert "restarting the workers" not in pods[group].text()


LOST = r"the Lighthouse \(its Deployment's, http://\S+\) stopped accepting connections " \
       r"while 1 replica group\(s\) ran"


def lighthouse_replaced(sim: Cluster, pods: list, lighthouse: Process) -> Process:
    """The Lighthouse's pod lost: one line on each pod, whose group stops and waits; the
    Deployment's replacement at the same Service: every group starts again, in the same
    pods, from the last checkpoint."""
    resumed = [len(re.findall(r"resumed from \S+/step-\d+", p.text())) for p in pods]
    lighthouse.kill()
    for p in pods:
        p.wait_for(LOST, 60)
    lost_at = ledger(sim)[-1].step
    lighthouse = sim.start_deployment("train-lighthouse")
    wait_for(lambda: slots_after(sim, lost_at, [0, 1]), 300,
             "steps past the loss with the new Lighthouse")
    for p, before in zip(pods, resumed, strict=True):
        text = p.text()
        assert p.running and len(re.findall(LOST, text)) == 1, text[-3000:]
        assert len(re.findall(r"resumed from \S+/step-\d+", text)) > before, text[-3000:]
    return lighthouse


def test_a_lost_pod_costs_its_group_alone_and_its_replacement_heals(tmp_path):
    folder = kustomized(tmp_path, ["../cpu"], ["../replicas"])
    # one thread a worker everywhere: the fault-free run on one machine shares its cores
    # among three groups, and another thread count sums a matmul in another order
    sim = Cluster(folder, tmp_path, env=clean_env(OMP_NUM_THREADS="1"))
    try:
        (sim.configmap("train-config") / "config.yaml").write_text(yaml.safe_dump(CONFIG))
        lighthouse = sim.start_deployment("train-lighthouse")
        lighthouse.wait_for(r"the replica groups' Lighthouse", 60)
        args = ["data.num_workers=0"]
        pods = [sim.start_index(JOB, i, args) for i in range(3)]
        wait_for(lambda: len(ledger(sim)) >= 20, limit(300), "20 committed steps")
        before = workers(sim)
        assert sorted(before) == [0, 1, 2], before
        # 1. group 1's pod killed: the spare takes its slot at once, the others' pids stay
        lost_at = replaced(sim, pods, 1, args)
        wait_for(lambda: slots_after(sim, lost_at, [0, 2]), limit(120), "the spare in slot 1")
        # ... and the recreated index heals and trains its slot again
        wait_for(lambda: slots_after(sim, lost_at, [0, 1]), limit(300), "group 1 back")
        pods[1].wait_for(r"replica group 1 healed from a live peer", 30)
        after = workers(sim)
        assert after[0] == before[0] and after[2] == before[2], (before, after)
        # 2. group 0's node frozen, then continued: left behind, then back in its slot
        frozen_and_thawed(sim, pods, 0)
        # 3. the spare's link cut: one wait of the all-reduce, then on without it
        if sim.net is not None:
            sim.vanish(pods[2])
            cut_at = ledger(sim)[-1].step
            wait_for(lambda: ledger(sim)[-1].step > cut_at + 20, limit(120),
                     "20 steps after the cut")
            replaced(sim, pods, 2, args)
            wait_for(lambda: 2 in workers(sim) and workers(sim)[2] != before[2],
                     limit(300), "the spare's new worker")
            pods[2].wait_for(r"replica group 2 healed from a live peer", 120)
            assert workers(sim)[0] == before[0] and workers(sim)[1] == after[1]
        # 4. the Lighthouse's pod lost and replaced: every group from the last checkpoint
        lighthouse = lighthouse_replaced(sim, pods, lighthouse)
        # 5. a drain: every group stops at one step, one checkpoint, exit 143 each
        for p in pods:
            p.signal(signal.SIGTERM)
        codes = [p.wait(120) for p in pods]
    finally:
        sim.close()
    text = "\n=====\n".join(p.text()[-3000:] for p in pods)
    assert codes == [143, 143, 143], text
    assert "Traceback" not in "".join(p.text() for p in pods)
    runs = sim.work / "pvc" / "train-runs" / "train-demo"
    stopped = int((runs / "checkpoints" / "latest").read_text().strip().split("-")[1])
    entries = ledger(sim)
    assert [e.step for e in entries] == list(range(1, stopped + 1))
    assert check_exactly_once(entries) == []
    # the fault-free run of as many steps, on one machine
    ref = tmp_path / "ref.yaml"
    ref.write_text(yaml.safe_dump({**CONFIG, "output": {"dir": str(tmp_path / "ref")}}))
    out = subprocess.run([sys.executable, ENTRY, "train", str(ref), *args,
                          "distributed.fault_tolerance=replicas", "distributed.replicas=2",
                          "distributed.spares=1", f"train.max_steps={stopped}"],
                         cwd=tmp_path, env=sim.base_env, capture_output=True, text=True,
                         timeout=limit(600))
    assert out.returncode == 0, out.stderr[-3000:]
    mine = torch.load(runs / "checkpoints" / f"step-{stopped}" / "state.pt",
                      weights_only=True)["model"]
    want = torch.load(tmp_path / "ref" / "train-demo" / "checkpoints" / f"step-{stopped}" /
                      "state.pt", weights_only=True)["model"]
    assert all(torch.equal(mine[k], want[k]) for k in want), \
        max(float((mine[k] - want[k]).abs().max()) for k in want)
