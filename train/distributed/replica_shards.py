"""What replica groups exchange when each group runs FSDP: every rank's own shards.

Every group has the same number of processes, so rank ``r`` of one group holds the same
pieces of every parameter (FSDP2 shards dim 0 over the group's ranks) as rank ``r`` of
any other, and the cross-group process group joins exactly those ranks
(:mod:`train.distributed.replica_group`). So a rank sums its local gradient shard with
its peers' (the shards' concatenation, not the full gradient: a group's FSDP has
already reduce-scattered it), and a rank that heals receives its peer's local shards of
the model and the optimizer state.

A heal's payload is read ``weights_only``, which takes tensors and plain values: a
DTensor travels as its local tensor plus its global shape and stride, and is rebuilt
on the receiver around the receiver's own mesh and placements (those of its parameter).
Without FSDP nothing here changes a value: plain tensors pass through.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

SHARD = "__local_shard__"  # the marker of a DTensor sent as its local tensor


def _dtensor_class():
    """DTensor, when something (FSDP) loaded it; never imports it."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``t``: its local tensor for a DTensor (a view: writing it
    writes the DTensor), ``t`` itself otherwise."""
    cls = _dtensor_class()
    if cls is not None and isinstance(t, cls):
        with torch.no_grad():
            return t.to_local()
    return t


def local_grads(params: list[nn.Parameter]) -> list[torch.Tensor]:
    """Each parameter's local gradient, zeros for one without (a group that computed no
    slot): views that the summed values are copied back into."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [local(p.grad) for p in params]


def portable(tree: Any) -> Any:
    """``tree`` with every DTensor replaced by its local tensor, shape and stride (what
    ``weights_only`` reads); everything else as it is."""
    cls = _dtensor_class()
    if cls is None:
        return tree
    if isinstance(tree, cls):
        return {SHARD: local(tree), "shape": list(tree.shape), "stride": list(tree.stride())}
    if isinstance(tree, dict):
        return {k: portable(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(portable(v) for v in tree)
    return tree


def _is_shard(value: Any) -> bool:
    return isinstance(value, dict) and SHARD in value


def _rebuilt(value: Any, like: torch.Tensor) -> Any:
    """A portable shard as a DTensor laid out as ``like`` (this rank's parameter)."""
    if not _is_shard(value):
        return value
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(value[SHARD].to(like.device), like.device_mesh, like.placements,
                              run_check=False, shape=torch.Size(value["shape"]),
                              stride=tuple(value["stride"]))


def model_state(saved: dict[str, Any], module: nn.Module) -> dict[str, Any]:
    """A peer's portable model state, ready for ``module.load_state_dict``."""
    if not any(_is_shard(v) for v in saved.values()):
        return saved
    mine = module.state_dict()
    return {name: _rebuilt(v, mine[name]) for name, v in saved.items()}


def optimizer_state(saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A peer's portable optimizer state, ready for ``optimizer.load_state_dict``: each
    state tensor that was a DTensor rebuilt around its parameter (state keys are the
    parameters' positions across the param groups, in order)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {index: {k: _rebuilt(v, params[int(index)]) for k, v in entry.items()}
             for index, entry in saved["state"].items()}
    return {**saved, "state": state}
