"""Wrapping a pure model for training: activation checkpointing, compile, and the
parallel strategy (single, DataParallel, DDP, FSDP2).

Wrapping never renames parameters of the plain module, so checkpoints load whatever
the strategy or memory settings were when they were written.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from train.core.config import Config
from train.core.errors import CannotRunHere, ConfigError
from train.core.machine.placement import check_gpu_only, one_process_problem, runs_one_process
from train.core.run.identity import WorkerIdentity
from train.distributed import compiler_stack
from train.distributed.full_state import is_fsdp, load_model_and_optimizer, model_and_optimizer
from train.distributed.precision import autocast_dtype

log = logging.getLogger("train")


def _with_forward(module: nn.Module, name: str, wrap) -> None:
    """Give one module instance a forward wrapped by `wrap(call, *args)`, by swapping in
    a subclass.

    Not an instance attribute: DataParallel's replicas copy the instance dict, and a
    bound method there would run the original (device 0) module. The original class is
    captured, not found through super(), so a later subclass (FSDP2 makes one) cannot
    make the wrapper call itself. State-dict names do not change.
    """
    cls = type(module)

    def forward(self, *args, **kwargs):
        return wrap(functools.partial(cls.forward, self), *args, **kwargs)

    module.__class__ = type(f"{name}{cls.__name__}", (cls,), {"forward": forward,
                                                               "_wrapped_class": cls})


def _recompute_in_backward(call, *args, **kwargs):
    return checkpoint(call, *args, use_reentrant=False, **kwargs)


def blocks_of(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a model, which FSDP shards one by one and activation
    checkpointing recomputes: its ``blocks`` (a ModuleList, as gpt has), else the
    submodules whose class is named in its ``_no_split_modules`` (the hint Hugging Face
    models carry), in order."""
    return _blocks_and_source(module)[0]


def _blocks_and_source(module: nn.Module) -> tuple[list[nn.Module], str]:
    blocks = getattr(module, "blocks", None)
    if isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        return list(blocks), "its `blocks`"
    names = set(getattr(module, "_no_split_modules", None) or ())
    # along the class's bases: a block whose forward _with_forward wrapped (activation
    # checkpointing, before FSDP) is an instance of a subclass named Checkpointed<Block>
    found = [m for m in module.modules()
             if m is not module and any(c.__name__ in names for c in type(m).__mro__)]
    return found, "its _no_split_modules"


def _class_name(block: nn.Module) -> str:
    """A block's own class name, not that of the subclass _with_forward swapped in."""
    cls = type(block)
    while "_wrapped_class" in vars(cls):
        cls = vars(cls)["_wrapped_class"]
    return cls.__name__


def describe_blocks(module: nn.Module) -> str:
    """What FSDP shards one by one in ``module``, for the log: class names and counts."""
    blocks, source = _blocks_and_source(module)
    root = _class_name(module)
    if not blocks:
        return (f"{root} as one unit (no `blocks` ModuleList and no _no_split_modules "
                "naming its block classes)")
    counts = Counter(_class_name(block) for block in blocks)
    each = ", ".join(f"{n} x {name}" for name, n in counts.items())
    return f"{each} (by {source}), then the rest of {root}"


def apply_activation_checkpointing(module: nn.Module, mode: str, every_n: int) -> int:
    """Recompute the chosen blocks' activations in backward. Returns how many blocks."""
    if mode == "none":
        return 0
    blocks = blocks_of(module)
    if not blocks:
        raise ConfigError("config", "memory.activation_checkpointing",
                          f"{type(module).__name__} has no blocks to recompute: give it a "
                          "`blocks` ModuleList or a `_no_split_modules` list of block class "
                          "names, or set it to none")
    chosen = [b for i, b in enumerate(blocks) if mode == "full" or i % every_n == 0]
    for block in chosen:
        _with_forward(block, "Checkpointed", _recompute_in_backward)
    return len(chosen)


def autocast_inside(module: nn.Module, dtype: torch.dtype) -> None:
    """DataParallel runs replicas in threads that do not inherit the caller's autocast
    dtype (they would run fp16 for bf16): autocast inside forward instead."""
    def wrap(call, *args, **kwargs):
        with torch.autocast("cuda", dtype=dtype):
            return call(*args, **kwargs)
    _with_forward(module, "Autocast", wrap)


def _fsdp(module: nn.Module, cfg: Config, device: torch.device, main: bool) -> nn.Module:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs = {}
    dtype = autocast_dtype(cfg.precision)
    if dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if cfg.memory.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    if main:
        log.info("fsdp: sharding %s", describe_blocks(module))
    for block in blocks_of(module):
        fully_shard(block, **kwargs)
    fully_shard(module, **kwargs)
    return module


def check_placement(cfg: Config, env: WorkerIdentity, device: torch.device, source: str) -> None:
    """The launcher's rules again, for a worker started without it (exit 2 or 3)."""
    strategy = cfg.distributed.strategy
    if runs_one_process(strategy) and env.distributed:
        raise CannotRunHere(one_process_problem(strategy, f"WORLD_SIZE={env.world_size}"))
    check_gpu_only(cfg, device.type == "cuda", source)


def parallelize(module: nn.Module, cfg: Config, env: WorkerIdentity,
                device: torch.device) -> nn.Module:
    """Compile and wrap; activation checkpointing is applied before (it changes memory use,
    which the micro-batch probe must see). Without compile, torch's compiler stays
    unloaded (compiler_stack), except under FSDP: its hooks call torch._dynamo.disable at
    every call, a use no test of the stand-in covers, so FSDP keeps torch's own."""
    strategy = cfg.distributed.strategy
    if cfg.compile:
        module.compile()
        if env.is_main:  # the compile happens in the first forward: say why step 1 waits
            log.info("compile: the model is compiled in its first steps (torch.compile: "
                     "tens of seconds on CPU, minutes for large models), then steps run "
                     "compiled")
    elif strategy != "fsdp":
        compiler_stack.keep_unloaded(env)
    if strategy == "dp":
        dtype = autocast_dtype(cfg.precision)
        if dtype is not None:
            autocast_inside(module, dtype)
        return nn.DataParallel(module)
    if strategy == "fsdp":  # also on one process: CPU offload and mixed precision apply
        return _fsdp(module, cfg, device, env.is_main)
    if not env.distributed:
        return module
    return DDP(module, device_ids=[device.index] if device.type == "cuda" else None)


def _state_options(model: nn.Module, *, loading: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    sharded = is_fsdp(model)
    # Full (unsharded) tensors on rank 0: one checkpoint format for every strategy,
    # loadable at any world size and by `export` without this trainer.
    return StateDictOptions(full_state_dict=True, cpu_offload=sharded and not loading,
                            broadcast_from_rank0=sharded and loading)


def state_target(model: nn.Module) -> nn.Module:
    """FSDP shards in place; DDP and DataParallel hold the plain module as .module, whose
    names carry no wrapper prefix."""
    return model if is_fsdp(model) else getattr(model, "module", model)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Collective under FSDP: every rank calls it; rank 0 gets the full tensors."""
    target = state_target(model)
    short = model_and_optimizer(target, optimizer)
    if short is not None:
        return short
    from torch.distributed.checkpoint.state_dict import get_state_dict
    return get_state_dict(target, optimizer, options=_state_options(target, loading=False))


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict,
                    optim_state: dict) -> None:
    """Collective under FSDP; parameter names are those of the plain module."""
    target = state_target(model)
    if load_model_and_optimizer(target, optimizer, model_state, optim_state):
        return
    from torch.distributed.checkpoint.state_dict import set_state_dict
    set_state_dict(target, optimizer, model_state_dict=model_state,
                   optim_state_dict=optim_state, options=_state_options(target, loading=True))
