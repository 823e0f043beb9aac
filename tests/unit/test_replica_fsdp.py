"""FSDP inside replica groups: which combinations the config accepts, and what a rank
exchanges with the same rank of the other groups (its gradient shards in the step's sum,
its model and optimizer shards in a heal, over the weights-only transport). A real FSDP2
model on a process group of one; groups of several processes for real:
tests/e2e/test_replica_fsdp_runs.py."""

from __future__ import annotations

import importlib.util
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.harness.runs import TINY_MLP, merge, write_config
from train.core.config import load_config
from train.core.errors import ConfigError

REPLICAS = {"distributed": {"fault_tolerance": "replicas", "replicas": 2}}


def config(tmp_path, overrides: list[str]):
    tree = merge(TINY_MLP, {**REPLICAS, "output": {"dir": str(tmp_path)}})
    return load_config(write_config(tmp_path / "c.yaml", tree), overrides)


def test_fsdp_in_replica_groups_is_accepted(tmp_path):
    cfg = config(tmp_path, ["distributed.strategy=fsdp"])
    assert cfg.distributed.strategy == "fsdp" and cfg.sharded_checkpoints


@pytest.mark.parametrize("overrides,key,fragment", [
    (["distributed.strategy=fsdp", "memory.cpu_offload=true"], "memory.cpu_offload",
     "true with distributed.fault_tolerance=replicas"),
    (["distributed.strategy=dp"], "distributed.strategy", "single, ddp or fsdp"),
])
def test_what_replica_groups_cannot_run_is_exit_2_naming_the_key(tmp_path, overrides, key,
                                                                fragment):
    with pytest.raises(ConfigError) as caught:
        config(tmp_path, overrides)
    line = caught.value.one_line()
    assert caught.value.exit_code == 2 and "\n" not in line
    assert f"{key}: " in line and fragment in line, line


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded_model(seed: int = 0):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    fully_shard(model[0])
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def train_once(model, optimizer, x: torch.Tensor) -> None:
    optimizer.zero_grad()
    model(x).square().sum().backward()
    optimizer.step()


def test_the_cross_group_sum_writes_back_into_each_gradient_shard(one_process_group):
    from train.loop.replica_loop import sum_across_groups
    model, _ = sharded_model()
    model(torch.ones(2, 5)).sum().backward()
    grads = {name: p.grad.to_local().clone() for name, p in model.named_parameters()}
    doubling = SimpleNamespace(sum=lambda flat: flat.mul_(2))
    extras = sum_across_groups(SimpleNamespace(model=model, device=torch.device("cpu")),
                               doubling, [1.5, 0.0])
    assert extras.tolist() == [3.0, 0.0]
    for name, p in model.named_parameters():
        assert type(p.grad).__name__ == "DTensor"  # still a shard: clipping and the step
        assert torch.equal(p.grad.to_local(), 2 * grads[name]), name


@pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="needs torchft")
def test_a_heal_carries_each_ranks_shards_and_the_healed_rank_trains_on_equal(
        one_process_group):
    from train.distributed.replica_group import _weights_only_transport
    from train.distributed.replica_shards import model_state, optimizer_state, portable
    peer_model, peer_optimizer = sharded_model()
    train_once(peer_model, peer_optimizer, torch.ones(2, 5))
    timeout = timedelta(seconds=30)
    peer, healer = _weights_only_transport(timeout), _weights_only_transport(timeout)
    try:
        peer.send_checkpoint(dst_ranks=[1], step=1, timeout=timeout, state_dict={
            "model": portable(peer_model.state_dict()),
            "optimizer": portable(peer_optimizer.state_dict())})
        got = healer.recv_checkpoint(src_rank=0, metadata=peer.metadata(), step=1,
                                     timeout=timeout)
    finally:
        peer.shutdown()
        healer.shutdown()
    model, optimizer = sharded_model(seed=1)  # another start: everything comes from the peer
    model.load_state_dict(model_state(got["model"], model))
    optimizer.load_state_dict(optimizer_state(got["optimizer"], optimizer))
    assert type(optimizer.state_dict()["state"][0]["exp_avg"]).__name__ == "DTensor"
    x = torch.randn(4, 5)
    train_once(model, optimizer, x)
    train_once(peer_model, peer_optimizer, x)
    for mine, theirs in zip(model.parameters(), peer_model.parameters(), strict=True):
        assert torch.equal(mine.to_local(), theirs.to_local())
