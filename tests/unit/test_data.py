"""Data contract: the global order does not depend on world size; datasets load real files."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from tests.harness.procs import alive
from tests.harness.runs import ROOT, TINY_GPT, TINY_MLP, limit, merge, worker_env, write_config
from train.core.config import load_config
from train.core.machine.host import cgroup_cpu_quota
from train.data.builders import build_data, read_text_corpus
from train.data.loader import make_loader
from train.data.order import GlobalOrder, RankBatchSampler, eval_indices


def steps_seen(order: GlobalOrder, world: int, micro: int, g: int, start: int, end: int):
    """Per step, the union over ranks of the samples each rank's sampler yields."""
    per_rank_micro = g // world // micro
    samplers = [iter(RankBatchSampler(order, global_batch_size=g, rank=r, world_size=world,
                                      micro_batch_size=micro, start_step=start, end_step=end))
                for r in range(world)]
    out = []
    for _ in range(start, end):
        step = []
        for s in samplers:
            for _ in range(per_rank_micro):
                step += next(s)
        out.append(step)
    return out


@pytest.mark.parametrize("world,micro", [(2, 2), (4, 1), (3, 4), (6, 2)])
def test_global_batches_do_not_depend_on_world_size(world, micro):
    n, g = 103, 12  # n not a multiple of g: batches straddle epoch boundaries
    single = steps_seen(GlobalOrder(n, seed=7), 1, g, g, 0, 30)
    multi = steps_seen(GlobalOrder(n, seed=7), world, micro, g, 0, 30)
    assert multi == single


def test_resume_and_resize_continue_at_the_next_sample():
    n, g = 50, 10
    whole = steps_seen(GlobalOrder(n, 3), 1, 10, g, 0, 12)
    resized = steps_seen(GlobalOrder(n, 3), 1, 10, g, 0, 5) + \
        steps_seen(GlobalOrder(n, 3), 2, 5, g, 5, 12)
    assert resized == whole


def test_each_epoch_is_a_permutation_and_epochs_differ():
    order = GlobalOrder(40, seed=1)
    first, second = order.take(0, 40), order.take(40, 40)
    assert sorted(first) == list(range(40)) == sorted(second)
    assert first != second
    assert GlobalOrder(40, seed=2).take(0, 40) != first


def test_loader_with_worker_processes_yields_the_sampler_order(tmp_path):
    cfg = load_config(write_config(tmp_path / "c.yaml", TINY_MLP))
    data = build_data(cfg)
    order = GlobalOrder(len(data.train), cfg.seed)
    sampler = RankBatchSampler(order, global_batch_size=16, rank=1, world_size=2,
                               micro_batch_size=4, start_step=3, end_step=6)
    loader = make_loader(data.train, sampler, num_workers=2, pin_memory=False,
                         persistent_workers=True, prefetch_factor=2, seed=0)
    got = [x for x, _ in loader]
    want = [data.train.features[torch.tensor(idx)] for idx in sampler]
    assert len(got) == len(want) == 6
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def _pdeathsig() -> int:
    value = ctypes.c_int(0)
    ctypes.CDLL(None).prctl(2, ctypes.byref(value), 0, 0, 0)  # PR_GET_PDEATHSIG
    return value.value


def _user_init(worker_id: int) -> None:
    """A user's worker_init_fn: runs after the loader's own setup, in the worker."""
    os.environ["USER_INIT"] = f"{worker_id}:{signal.getsignal(signal.SIGTERM) is signal.SIG_IGN}"


class WhoServes(torch.utils.data.Dataset):
    """Each sample: the serving process, its stop-signal handling, its seed."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int):
        time.sleep(0.02)
        return {"pid": os.getpid(), "pdeathsig": _pdeathsig(), "seed": torch.initial_seed(),
                "term": signal.getsignal(signal.SIGTERM), "int": signal.getsignal(signal.SIGINT),
                "user": os.environ.get("USER_INIT")}


def test_loader_workers_leave_stop_signals_to_the_main_process():
    """SIGTERM/SIGINT sent to the whole process group (systemd, scancel, timeout, Ctrl-C,
    torchrun) reach the loader's workers too: they ignore them, so the main process can
    checkpoint, and they die with it (parent-death SIGKILL). A user's worker_init_fn and
    torch's per-worker seeding still apply."""
    sampler = [[i, i + 1] for i in range(0, 48, 2)]
    loader = make_loader(WhoServes(), sampler, num_workers=2, pin_memory=False,
                         persistent_workers=False, prefetch_factor=2, seed=5,
                         worker_init_fn=_user_init)
    seen = []
    for k, batch in enumerate(loader):
        seen += batch
        if k == 1:  # as a signal to the group would: the workers get both, mid-iteration
            for pid in {s["pid"] for s in seen}:
                os.kill(pid, signal.SIGTERM)
                os.kill(pid, signal.SIGINT)
    assert len(seen) == 48, "every batch arrived; no worker died"
    workers = {s["pid"] for s in seen}
    assert len(workers) == 2 and os.getpid() not in workers
    assert all(s["term"] is signal.SIG_IGN and s["int"] is signal.SIG_IGN for s in seen)
    assert all(s["pdeathsig"] == signal.SIGKILL for s in seen)
    assert {s["user"] for s in seen} == {"0:True", "1:True"}
    assert len({s["seed"] for s in seen}) == 2, "torch still seeds each worker differently"
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN  # this process unchanged
    assert not signal.pthread_sigmask(signal.SIG_BLOCK, []) & {signal.SIGTERM, signal.SIGINT}


STUCK_LOADER = """
import os, sys, time
import torch
from train.data.loader import make_loader

class Stuck(torch.utils.data.Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        # one write: two workers' prints may interleave on an unbuffered stdout
        os.write(1, f"{os.getpid()}\\n".encode())
        time.sleep(120)  # a dataset call that never returns (a stuck file system read)

loader = make_loader(Stuck(), [[0], [1], [2], [3]], num_workers=2, pin_memory=False,
                     persistent_workers=False, prefetch_factor=1, seed=0)
next(iter(loader))
"""


def test_loader_workers_die_with_a_killed_main_process(tmp_path):
    """kill -9 of the main process: its loader workers go at once, even in the middle of a
    dataset call (torch's own check of the parent runs only between samples)."""
    (tmp_path / "stuck.py").write_text(STUCK_LOADER)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "stuck.py")], cwd=ROOT,
                            env=worker_env(), stdout=subprocess.PIPE, text=True)
    try:
        workers = {int(proc.stdout.readline()) for _ in range(2)}
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    deadline = time.monotonic() + limit(3)
    left = workers
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = {p for p in workers if alive(p)}
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "loader workers outlived the main process"


def test_eval_subset_is_the_same_for_any_world_size():
    for world in (1, 2, 3, 5):
        parts = [eval_indices(100, 3, 8, r, world) for r in range(world)]
        assert [i for part in parts for i in part] == list(range(24))


def test_text_corpus_is_sorted_capped_and_skips_site_packages(tmp_path):
    (tmp_path / "b.py").write_text("bbbb")
    (tmp_path / "a.py").write_text("aaaa")
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "0.py").write_text("xxxx")
    (tmp_path / "notes.txt").write_text("tttt")
    assert read_text_corpus(tmp_path, "**/*.py", 0) == b"aaaabbbb"
    assert read_text_corpus(tmp_path, "**/*.py", 6) == b"aaaabb"


def test_text_windows_are_next_byte_targets(tmp_path):
    (tmp_path / "t.txt").write_bytes(bytes(range(256)) * 4)
    cfg = load_config(write_config(tmp_path / "c.yaml", merge(TINY_GPT, {
        "data": {"path": str(tmp_path), "text_glob": "*.txt", "val_fraction": 0.1}})))
    data = build_data(cfg)
    x, y = data.train[3]
    assert torch.equal(x[1:], y[:-1])
    assert x[0].item() == (3 * 16) % 256
    assert len(data.train) + len(data.val) == (1024 - 1) // 16
    assert data.num_classes == 256 and data.data_hash


def test_tokens_memmap(tmp_path):
    tokens = (np.arange(5000) * 7 % 1000).astype(np.uint16)
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    cfg = load_config(write_config(tmp_path / "c.yaml", merge(TINY_GPT, {
        "data": {"kind": "tokens", "path": str(path), "vocab_size": 1000}})))
    data = build_data(cfg)
    x, y = data.train.__getitems__([0, 2])
    assert x.dtype == torch.int64 and x.shape == (2, 16)
    assert torch.equal(x[1], torch.from_numpy(tokens[32:48].astype(np.int64)))
    assert torch.equal(y[1], torch.from_numpy(tokens[33:49].astype(np.int64)))


@pytest.mark.parametrize("fmt", ["pt", "npy"])
def test_tensors_from_files(tmp_path, fmt):
    x = torch.randn(40, 3)
    y = torch.arange(40) % 5
    extra = {}
    if fmt == "pt":
        torch.save({"features": x, "labels": y}, tmp_path / "d.pt")
    else:
        np.save(tmp_path / "d.npy", x.numpy())
        np.save(tmp_path / "y.npy", y.numpy())
        extra = {"labels_path": str(tmp_path / "y.npy")}
    cfg = load_config(write_config(tmp_path / "c.yaml", merge(TINY_MLP, {
        "data": {"kind": "tensors", "path": str(tmp_path / f"d.{fmt}"), "val_fraction": 0.25,
                 **extra}})))
    data = build_data(cfg)
    assert len(data.train) == 30 and len(data.val) == 10
    assert data.input_shape == (3,) and data.num_classes == 5
    assert torch.equal(data.val.features, x[30:])


def test_synthetic_is_exact_from_seed_and_learnable_labels_are_balanced(tmp_path):
    cfg = load_config(write_config(tmp_path / "c.yaml", TINY_MLP))
    a, b = build_data(cfg), build_data(cfg)
    assert a.data_hash == b.data_hash
    assert torch.equal(a.train.features, b.train.features)
    counts = torch.bincount(a.train.labels, minlength=4)
    assert counts.min() > 0.1 * counts.sum()


@pytest.mark.parametrize("v2,expect", [("max 100000\n", None), ("150000 100000\n", 1.5)])
def test_cgroup_v2_cpu_quota(tmp_path, v2, expect):
    (tmp_path / "cpu.max").write_text(v2)
    assert cgroup_cpu_quota(tmp_path) == expect


def test_cgroup_v1_cpu_quota(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("250000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(tmp_path) == 2.5


def test_cgroup_quota_is_the_process_groups_and_the_smallest_above_it(tmp_path):
    """/proc/self/cgroup names the group; a quota on it or any parent counts, the
    mount's top (all a container with its own cgroup namespace sees) too."""
    group = tmp_path / "ci.slice" / "job-7"
    group.mkdir(parents=True)
    (group / "cpu.max").write_text("300000 100000\n")
    (tmp_path / "ci.slice" / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(tmp_path, "0::/ci.slice/job-7\n") == 1.5
    (tmp_path / "ci.slice" / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path, "0::/ci.slice/job-7\n") == 3.0
    assert cgroup_cpu_quota(tmp_path, "0::/\n") is None  # the top has no cpu.max
    # a path this mount does not have (no cgroup namespace): the mount's top is the group
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    assert cgroup_cpu_quota(tmp_path, "0::/docker/abc\n") == 1.0


def test_cgroup_v1_quota_follows_the_cpu_controllers_line(tmp_path):
    group = tmp_path / "cpu" / "runner" / "job"
    group.mkdir(parents=True)
    (group / "cpu.cfs_quota_us").write_text("50000\n")
    (group / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    membership = "4:memory:/elsewhere\n2:cpu,cpuacct:/runner/job\n0::/\n"
    assert cgroup_cpu_quota(tmp_path, membership) == 0.5
    assert cgroup_cpu_quota(tmp_path, "2:cpu,cpuacct:/\n") is None
