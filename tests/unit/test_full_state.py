"""The full checkpoint format's short path (train/distributed/full_state.py) writes and
loads exactly what torch's distributed state-dict API does, for the models it takes,
and hands the others to that API."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from train.core.config import OptimConfig
from train.core.config.schema import ModelConfig
from train.distributed import full_state
from train.models import GPT
from train.models.optim import build_optimizer

FULL = StateDictOptions(full_state_dict=True)


def tied_gpt() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The quick start's kind of model: tied embedding, two parameter groups (decay and
    no decay), AdamW."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(kind="gpt", depth=2, width=32, heads=2, context_length=16,
                            dropout=0.0, tie_weights=True), 64)
    return model, build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.1))


def frozen_mlp() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A frozen layer the optimizer never sees, a buffer, SGD with momentum."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
    model[0].requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.SGD(trainable, lr=0.1, momentum=0.9)


def step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    if isinstance(model, GPT):
        loss = model(torch.randint(0, 64, (4, 16))).float().sum()
    else:
        loss = model(torch.randn(4, 8)).sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def same(a, b) -> bool:
    """Equal structure, key order included, and bitwise-equal tensors of one dtype."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


@pytest.mark.parametrize("build", [tied_gpt, frozen_mlp])
def test_the_short_path_saves_what_torchs_api_saves(build):
    model, optimizer = build()
    step(model, optimizer, 1)
    short = full_state.model_and_optimizer(model, optimizer)
    assert short is not None, "the short path applies to a plain model"
    assert same(short, get_state_dict(model, optimizer, options=FULL))


def through_a_file(obj):
    """What a checkpoint gives back: fresh tensors, nothing shared with the saver."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("build", [tied_gpt, frozen_mlp])
def test_resumed_by_the_short_path_equals_uninterrupted_and_torchs_api(build):
    trained, trained_optimizer = build()
    for seed in (1, 2):
        step(trained, trained_optimizer, seed)
    saved = get_state_dict(trained, trained_optimizer, options=FULL)
    ours, ours_optimizer = build()
    theirs, their_optimizer = build()
    assert full_state.load_model_and_optimizer(ours, ours_optimizer, *through_a_file(saved))
    model_state, optim_state = through_a_file(saved)
    set_state_dict(theirs, their_optimizer, model_state_dict=model_state,
                   optim_state_dict=optim_state, options=FULL)
    for model, optimizer in ((trained, trained_optimizer), (ours, ours_optimizer),
                             (theirs, their_optimizer)):
        step(model, optimizer, 3)
    assert same(ours.state_dict(), trained.state_dict())
    assert same(ours_optimizer.state_dict(), trained_optimizer.state_dict())
    assert same(theirs.state_dict(), trained.state_dict())


def test_what_the_short_path_does_not_take_goes_to_torchs_api():
    model, optimizer = tied_gpt()
    assert full_state.model_and_optimizer(model, optimizer) is None, \
        "an optimizer never stepped: torch's API gives it its state first"
    step(model, optimizer, 1)
    wrapped = nn.Sequential()
    wrapped.add_module("_orig_mod", model)  # a name torch's API translates
    assert full_state.model_and_optimizer(wrapped, optimizer) is None
    saved = full_state.model_and_optimizer(model, optimizer)
    fresh, fresh_optimizer = tied_gpt()
    regrouped = {**saved[1], "param_groups": saved[1]["param_groups"][::-1]}
    assert not full_state.load_model_and_optimizer(fresh, fresh_optimizer, saved[0], regrouped)
    assert same(fresh.state_dict(), tied_gpt()[0].state_dict()), "nothing loaded"


def test_the_models_state_dict_hooks_run_once_a_save_as_with_torchs_api():
    model, optimizer = tied_gpt()
    step(model, optimizer, 1)
    calls = []
    model._register_state_dict_hook(lambda *args: calls.append(1))
    get_state_dict(model, optimizer, options=FULL)
    theirs = len(calls)
    full_state.model_and_optimizer(model, optimizer)
    assert len(calls) - theirs == theirs == 1
