"""What a run listens on, measured: every TCP socket its process tree listens on while it
trains (tests/harness/sockets.py reads them from /proc), for a run on one node (loopback
only) and for the rank-0 node of a multi-node job on a host with two addresses (only
the address the plan names: the one its name resolves to, never every interface, never
the other address). And a pickle written to the rendezvous store of a running job never
runs in torchrun's agent (it does in plain torchrun: the test shows that first).

docs/security.md's table of what is bound where is what these hold.
"""

from __future__ import annotations

import base64
import datetime
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import netns
from tests.harness.procs import descendants
from tests.harness.runs import (
    ENTRY,
    TINY_MLP,
    clean_env,
    limit,
    merge,
    worker_env,
    write_config,
)
from tests.harness.sockets import Listener, listening

RDZV_KEY = "torch.rendezvous."  # + run id: the pickled state torchrun's agents share
SECOND_ADDR = "198.18.0.200"     # one more address of the rank-0 node, which no one uses


def _config(tmp_path: Path, steps: int, name: str) -> Path:
    return write_config(tmp_path / f"{name}.yaml", merge(TINY_MLP, {
        "output": {"dir": str(tmp_path / "runs")}, "run": {"name": name},
        "train": {"max_steps": steps}, "checkpoint": {"every_steps": 0}}))


def _watch(pid: int, running, deadline_s: float) -> set[Listener]:
    """Every socket the tree below ``pid`` listened on while ``running()``."""
    seen: set[Listener] = set()
    deadline = time.monotonic() + limit(deadline_s)
    while running() and time.monotonic() < deadline:
        seen.update(listening({pid} | descendants(pid)))
        time.sleep(0.05)
    return seen


# ------------------------------------------------------------------------ one node

@pytest.mark.parametrize("nproc", [1, 2])
def test_a_run_on_one_node_listens_on_loopback_only(tmp_path, nproc):
    cfg = _config(tmp_path, 60, f"single{nproc}")
    proc = subprocess.Popen([sys.executable, ENTRY, "train", str(cfg), "device=cpu",
                             f"distributed.nproc_per_node={nproc}"], cwd=tmp_path,
                            env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        seen = _watch(proc.pid, lambda: proc.poll() is None, 300)
        out = proc.communicate(timeout=limit(60))[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-2000:]
    print(f"{nproc} process(es) listened on: {', '.join(map(str, sorted(seen))) or 'nothing'}")
    assert all(s.loopback for s in seen), sorted(seen)
    if nproc == 2:  # torchrun's store, the workers' store, gloo: each was there a while
        assert len({s.pid for s in seen}) >= 2, sorted(seen)


# ------------------------------------------------------------------ multi-node

def _node_env(kind: str, rank: int) -> dict:
    if kind == "static":  # Kubeflow v1: node 0's agent hosts the store at MASTER_PORT
        return clean_env(MASTER_ADDR="node0", MASTER_PORT="29500", WORLD_SIZE="2",
                         RANK=str(rank))
    # torchrun's variables, c10d: node0 hosts the rendezvous store (its name is the
    # endpoint's), and a worker on it the process group's store
    return clean_env(PET_NNODES="2", PET_RDZV_BACKEND="c10d", PET_RDZV_ENDPOINT="node0:29400",
                     PET_RDZV_ID=f"binding-{kind}", PET_NPROC_PER_NODE="2")


@pytest.mark.parametrize("kind", ["static", "c10d"])
def test_a_node_listens_only_on_the_address_its_name_resolves_to(net, tmp_path, kind):
    hosts = [net.host(f"node{i}") for i in range(2)]
    netns._ip("-n", hosts[0].netns, "addr", "add", f"{SECOND_ADDR}/24", "dev", "eth0")
    cfg = _config(tmp_path, 40, kind)
    nodes = []
    for rank, host in enumerate(hosts):
        p = host.process(f"node{rank}", [sys.executable, ENTRY, "train", str(cfg),
                                         "device=cpu"], _node_env(kind, rank), tmp_path)
        net.procs.append(p)
        nodes.append(p.start())
    seen = _watch(nodes[0].proc.pid, lambda: nodes[0].running, 400)
    for node in nodes:
        assert node.wait(limit(120)) == 0, node.text()[-2000:]
    print(f"{kind}: node0 ({hosts[0].addr}, also {SECOND_ADDR}) listened on: "
          f"{', '.join(map(str, sorted(seen)))}")
    reachable = {s for s in seen if not s.loopback}
    assert reachable and {s.address for s in reachable} == {hosts[0].addr}, sorted(seen)


# ----------------------------------------------------------------- the store's pickle

class _Touch:
    """Loaded by plain pickle, it creates ``path``: the stand-in for any code."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _write_to_stores(pids: set[int], value: bytes) -> list[str]:
    """Put ``value`` under every rendezvous state key of every store the processes
    listen on, as any client that reaches a port could; the keys written."""
    import torch.distributed as dist
    written = []
    for s in listening(pids):
        try:
            store = dist.TCPStore(s.address, s.port, is_master=False,
                                  timeout=datetime.timedelta(seconds=limit(5)))
            keys = [k for k in store.list_keys() if k.startswith(RDZV_KEY)
                    and "." not in k[len(RDZV_KEY):]]
        except Exception:  # not a store (gloo's listener), or gone
            continue
        for key in keys:
            store.set(key, value)
            written.append(f"{key} at {s}")
    return written


def _attack(cmd: list[str], env: dict, cwd: Path, marker: Path) -> tuple[list[str], str]:
    """Start a 2-process run, write the pickle into its store once its rendezvous is
    there, give the agent time to read it; what was written and the run's output."""
    import pickle
    value = base64.b64encode(pickle.dumps(_Touch(marker)))  # the c10d backend's encoding
    log = cwd / f"{marker.name}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    written: list[str] = []
    try:
        deadline = time.monotonic() + limit(180)
        while not written and proc.poll() is None and time.monotonic() < deadline:
            written = _write_to_stores({proc.pid} | descendants(proc.pid), value)
            time.sleep(0.2)
        # the agents read the state at every keep-alive (5 s) and monitor pass
        deadline = time.monotonic() + limit(30)
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=limit(60))
    return written, log.read_text()


def test_a_pickle_written_to_the_store_never_runs_in_the_agent(tmp_path):
    cfg = _config(tmp_path, 100000, "target")  # runs until the test stops it
    # plain torchrun, the same job: the pickle runs (what the agent's allow-list prevents)
    plain = tmp_path / "ran-in-plain-torchrun"
    written, _ = _attack([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node=2", "-m", "train", str(cfg), "device=cpu"],
                         worker_env(), tmp_path, plain)
    assert written and plain.exists(), "the attack did not reach plain torchrun's agent"
    ours = tmp_path / "ran-in-the-launcher"
    written, out = _attack([sys.executable, ENTRY, "train", str(cfg), "device=cpu",
                            "distributed.nproc_per_node=2"], clean_env(), tmp_path, ours)
    print("\n".join(written))
    assert written and not ours.exists(), out[-3000:]
    assert "the rendezvous state in the store is not torch's, not loaded" in out, out[-3000:]
