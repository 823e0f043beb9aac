"""What a replica group that heals accepts from a peer: torchft's HTTP transport as the
project uses it reads tensors and plain values only (``weights_only``), like a checkpoint."""

from __future__ import annotations

import importlib.util
import pickle
from datetime import timedelta

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                                reason="needs torchft (make ft)")


class Payload:
    """Stands for what an attacker's pickle would construct: any class at all."""
    def __reduce__(self):
        return (print, ("code ran",))


def heal(state) -> object:
    from train.distributed.replica_group import _weights_only_transport
    timeout = timedelta(seconds=30)
    peer, healer = _weights_only_transport(timeout), _weights_only_transport(timeout)
    try:
        peer.send_checkpoint(dst_ranks=[1], step=7, state_dict=state, timeout=timeout)
        return healer.recv_checkpoint(src_rank=0, metadata=peer.metadata(), step=7,
                                      timeout=timeout)
    finally:
        peer.shutdown()
        healer.shutdown()


def test_a_heal_carries_tensors_and_plain_values_exactly():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state = {"user": {"default": {"model": model.state_dict(),
                                  "optimizer": optimizer.state_dict(),
                                  "progress": {"step": 7, "samples_consumed": 112}}},
             "torchft": {"step": 7, "batches_committed": 14}}
    got = heal(state)
    assert got["torchft"] == state["torchft"]
    mine = got["user"]["default"]
    assert all(torch.equal(mine["model"][k], v) for k, v in model.state_dict().items())
    assert mine["optimizer"]["param_groups"] == optimizer.state_dict()["param_groups"]
    assert mine["progress"] == {"step": 7, "samples_consumed": 112}


def test_a_heal_that_would_construct_an_object_is_refused(capsys):
    with pytest.raises(pickle.UnpicklingError):
        heal({"user": {"default": Payload()}})
    assert "code ran" not in capsys.readouterr().out
