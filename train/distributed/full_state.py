"""Whole-model state keyed by parameter name: what the full checkpoint format holds.

torch's distributed state-dict API (``get_state_dict`` / ``set_state_dict`` of
``torch.distributed.checkpoint.state_dict``) produces that layout for every wrapper,
FSDP included: the model's ``state_dict()`` under names without wrapper prefixes, and the
optimizer's ``state_dict()`` with each parameter's name where torch puts its position.
Importing that API loads torch.distributed.checkpoint, FSDP, DTensor and torch's
compiler stack: about 700 modules and 0.7-0.9 s, paid in the first save of every process
and in every resume, where a small model's save itself takes some 30 ms.

For a model that is not sharded and whose names need no translation, the API only
renames. That case takes the short path here, which produces the same layout (a test
compares the two on the models this trainer builds); anything else (FSDP, names carrying
a compile or checkpoint-wrapper prefix, an optimizer not yet stepped, parameter groups
that do not match the saved ones) goes through torch's API, as before.
"""

from __future__ import annotations

import sys
from itertools import chain

import torch
from torch import nn

# prefixes torch's API removes from names (torch.compile's wrapper, checkpoint_wrapper)
WRAPPER_PREFIXES = ("_orig_mod", "_checkpoint_wrapped_module")


def is_fsdp(model: nn.Module) -> bool:
    """Without importing FSDP: a model can only be sharded by it once it is loaded."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def _plain_names(model: nn.Module) -> bool:
    """Whether the model's state-dict names are already the names torch's API writes:
    read from its modules, not from a ``state_dict()`` (whose hooks, the model's own,
    must run once a save, as they do with torch's API)."""
    for name, module in model.named_modules():
        if hasattr(module, "_fqn_modifiers") or \
                any(prefix in name.split(".") for prefix in WRAPPER_PREFIXES):
            return False
    return True


def _names_by_position(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str] | None:
    """Each of the optimizer's parameters' names, in its order (the first name of a tied
    parameter, as torch's API takes it); None when one has no name in the model."""
    names = {param: name for name, param in model.named_parameters()}
    params = chain.from_iterable(group["params"] for group in optimizer.param_groups)
    found = [names.get(param) for param in params]
    return None if None in found else found


def model_and_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer
                        ) -> tuple[dict, dict] | None:
    """The model's and optimizer's state in the full format's layout, or None when the
    short path does not apply (then torch's API gives it)."""
    if is_fsdp(model) or not optimizer.state or not _plain_names(model):
        return None
    names = _names_by_position(model, optimizer)
    if names is None:
        return None
    saved = optimizer.state_dict()
    state = {names[position]: value for position, value in saved["state"].items()}
    groups = [{**group, "params": [names[p] for p in group["params"]]}
              for group in saved["param_groups"]]
    return model.state_dict(), {"state": state, "param_groups": groups}


def load_model_and_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer,
                             model_state: dict, optim_state: dict) -> bool:
    """Load the full format's state by the short path; False (nothing loaded) when it
    does not apply."""
    if is_fsdp(model) or not _plain_names(model):
        return False
    names = _names_by_position(model, optimizer)
    if names is None or not _same_groups(optimizer, optim_state, names):
        return False
    wanted = {name for name, param in model.named_parameters() if param.requires_grad}
    if not wanted <= set(optim_state["state"]):
        return False  # torch's API says which parameter lacks its state
    model.load_state_dict(model_state, strict=True)
    # torch's Optimizer.load_state_dict pairs saved and current parameters by position
    # within each group, whatever the saved keys are: the names line up (checked above)
    optimizer.load_state_dict(optim_state)
    return True


def _same_groups(optimizer: torch.optim.Optimizer, optim_state: dict,
                 names: list[str]) -> bool:
    saved = optim_state.get("param_groups")
    if not isinstance(saved, list) or len(saved) != len(optimizer.param_groups):
        return False
    at = 0
    for group, saved_group in zip(optimizer.param_groups, saved, strict=True):
        mine = names[at:at + len(group["params"])]
        at += len(group["params"])
        if saved_group.get("params") != mine:
            return False
    return True
