"""Building everything a run trains with, from the config plus the worker's runtime:
device and process group, data, model (wrapped for its strategy), optimizer,
schedule, grad scaler, checkpointer and the data loader.

The result is :class:`Components`: built once per attempt and never mutated by the
loop. Progress lives in :class:`train.checkpoint.state.TrainState`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from train.checkpoint import Checkpointer, formats
from train.checkpoint.factory import build_checkpointer
from train.checkpoint.state import TrainState
from train.core.config import AUTO, Config, batch_split
from train.core.config import tracking as tracker_config
from train.core.config.checks import check_batch_memory
from train.core.datasets.tokenfiles import is_remote
from train.core.errors import CannotRunHere
from train.core.machine.host import OUTPUT_DIR_FIX, available_memory, output_dir_problem
from train.core.nodes.verdict import Verdict
from train.core.run import rundir
from train.core.run.identity import WorkerIdentity
from train.core.storage import s3
from train.data.builders import DataBundle, build_data
from train.data.loader import make_loader
from train.data.order import BlockOrder, GlobalOrder, RankBatchSampler
from train.data.shardcache import count_fetches
from train.distributed import ranks
from train.distributed.parallel import apply_activation_checkpointing, check_placement, parallelize
from train.distributed.precision import autocast, grad_scaler
from train.guards import shared_dir
from train.models import build_model, losses
from train.models.autobatch import largest_fitting, probe_on_gpu
from train.models.optim import build_optimizer, build_scheduler

log = logging.getLogger("train")


@dataclass(frozen=True)
class Components:
    """What the loop trains with, built once from config plus the ranks."""
    cfg: Config
    source: str                 # the config file, for messages
    env: WorkerIdentity
    device: torch.device
    data: DataBundle
    model: nn.Module            # wrapped (DDP / DataParallel / FSDP) or plain
    module: nn.Module           # the plain module inside
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None
    micro: int                  # samples per forward pass on this rank
    accum: int                  # micro-batches per optimizer step
    checkpointer: Checkpointer
    checkpoint_format: formats.Format   # full or sharded, chosen once from the config
    objective: losses.Objective  # the model's forward and train.loss, for one batch
    # the preflight's link times, (node, peer node) -> ms: a two-node job's link baseline
    preflight_links: dict[tuple[int, int], float] | None = None
    # this rank's count of bytes fetched from object storage (None: data read from elsewhere)
    fetched: Callable[[], int] | None = None

    @property
    def run_dir(self) -> Path:
        return self.cfg.run_dir

    def autocast(self):
        return autocast(self.device.type, self.cfg.precision)

    def with_preflight(self, verdict: Verdict | None) -> Components:
        """With the preflight's link times (None: it did not run: a single node, off)."""
        return replace(self, preflight_links=verdict.link_times) if verdict else self


@dataclass(frozen=True)
class Placement:
    """What the pre-flight checks decided: where this rank runs and how it batches."""
    device: torch.device
    backend: str
    micro: int
    accum: int


def preflight(cfg: Config, env: WorkerIdentity, source: str) -> Placement:
    """The launcher's checks again (a bare worker has no launcher), before anything is
    written or any process group joined: exit 2 or 3 with one line, nothing changed."""
    problem = output_dir_problem(cfg.output.dir, create=True)
    if problem:
        raise CannotRunHere(f"{problem}; {OUTPUT_DIR_FIX}")
    rundir.check_no_links(cfg.run_dir)
    if env.is_main:
        tracker_config.check(cfg, source)
        s3.check(cfg.checkpoint.remote, cfg.run.name, source,
                 probe=not env.supervised)  # the launcher probed already
    micro, accum = batch_split(cfg, logical_world_size(cfg, env), source)
    check_batch_memory(cfg, env.world_size, source,
                       (available_memory() or 0) // env.local_world_size or None)
    device = ranks.resolve_device(cfg, env)
    check_placement(cfg, env, device, source)
    env.check_rendezvous()
    return Placement(device, ranks.resolve_backend(cfg, device), micro, accum)


def logical_world_size(cfg: Config, env: WorkerIdentity) -> int:
    """The ranks the global batch splits over: with replica groups, every group's
    (``distributed.replicas`` x the group's processes; spares take no share)."""
    if cfg.distributed.fault_tolerance == "replicas":
        return cfg.distributed.replicas * env.world_size
    return env.world_size


def build(cfg: Config, env: WorkerIdentity, source: str, placed: Placement) -> Components:
    device, backend, micro, accum = placed.device, placed.backend, placed.micro, placed.accum
    ranks.apply_comm_env(cfg, env, device, backend)
    ranks.init_distributed(env, backend, device, cfg.distributed.timeout_s,
                             single_process_group=cfg.distributed.strategy == "fsdp")
    env.check_consistent()
    torch.set_num_threads(env.threads_per_rank())
    ranks.set_deterministic(cfg.deterministic)
    ranks.seed_everything(cfg.seed, env.rank)
    objective = losses.Objective(cfg.train.loss, source)
    # objects, or your code's train.data.remote: counted from before the first fetch
    fetched = count_fetches() if cfg.data.kind == "custom" or is_remote(cfg.data.path) \
        else None
    data = build_data(cfg, source)
    module = build_model(cfg.model, input_shape=data.input_shape, num_classes=data.num_classes,
                         source=source)
    module.to(device)
    # Before anything is wrapped or trained: a model and loss that do not fit are exit 2
    objective.check(module, _one_sample(data, device),
                    lambda: autocast(device.type, cfg.precision),
                    "model.factory" if cfg.model.kind == "custom" else "model.kind")
    torch.manual_seed(cfg.seed + 1 + env.rank)  # per-rank dropout streams, after the shared init
    blocks = apply_activation_checkpointing(module, cfg.memory.activation_checkpointing,
                                            cfg.memory.activation_checkpointing_n)
    if blocks:
        log.info("activation checkpointing on %d blocks", blocks)
    if cfg.train.micro_batch_size == AUTO and device.type == "cuda" \
            and cfg.distributed.strategy != "fsdp":
        micro, accum = auto_micro_batch(cfg, env, module, data, device, micro * accum, objective)
    model = parallelize(module, cfg, env, device)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.schedule, cfg.train.max_steps)
    # several nodes: one run directory, or node-local (each node's own, with a remote)
    nodes = shared_dir.prepare(cfg.run_dir, env, remote=bool(cfg.checkpoint.remote))
    checkpointer = build_checkpointer(cfg, env, nodes)
    return Components(cfg, source, env, device, data, model, module, optimizer, scheduler,
                      grad_scaler(device.type, cfg.precision), micro, accum, checkpointer,
                      formats.for_config(cfg), objective, fetched=fetched)


def _one_sample(data: DataBundle, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Training sample 0 as a batch of one, on the device."""
    x, y = data.train.__getitems__([0])
    return x.to(device), y.to(device)


def auto_micro_batch(cfg: Config, env: WorkerIdentity, module: nn.Module, data: DataBundle,
                     device: torch.device, per_rank: int,
                     objective: losses.Objective) -> tuple[int, int]:
    """``train.micro_batch_size: auto`` on GPU: the largest size that fits on every rank."""
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    # AdamW keeps two moments (SGD one); DDP adds gradient buckets the size of the grads.
    later_bytes = params * (2 if cfg.optim.name == "adamw" else 1) \
        + (params if env.distributed else 0)
    n = len(data.train)
    fits = probe_on_gpu(module, lambda m: data.train.__getitems__([i % n for i in range(m)]),
                        objective, lambda: autocast("cuda", cfg.precision), device,
                        extra_bytes=later_bytes)
    micro = largest_fitting(per_rank, fits)
    if env.distributed:  # every rank must use the same size: the smallest that fit anywhere
        agreed = torch.tensor([micro], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        micro = int(agreed.item())  # a divisor of per_rank, as every rank's choice was
    log.info("train.micro_batch_size=auto: %d fits (per-rank batch %d)", micro, per_rank)
    return micro, per_rank // micro


def _read_ahead(c: Components, state: TrainState, sampler) -> None:
    """Files in object storage: fetched ahead of the steps that read them, by a thread."""
    train = c.data.train
    order = train_order(c)
    if isinstance(order, BlockOrder) and hasattr(train, "read_ahead_groups"):
        g = c.cfg.train.global_batch_size
        last = state.samples_consumed + (c.cfg.train.max_steps - state.step) * g
        # paced by the steps trained: the group before the next one to fetch is done
        # being read by every loader worker once training is in it
        train.read_ahead_groups(order, state.samples_consumed, last,
                                lambda: state.samples_consumed)
    elif hasattr(train, "read_ahead"):
        train.read_ahead(sampler())


def train_order(c: Components) -> GlobalOrder:
    """The global sample order ``data.shuffle`` names: every window shuffled, or the
    files' windows kept together in groups of half ``data.cache_bytes`` (token files;
    one file is one group)."""
    train, d = c.data.train, c.cfg.data
    if d.shuffle == "blocks" and hasattr(train, "layout"):
        return BlockOrder(len(train), c.cfg.seed, train.layout(), group_bytes=d.cache_bytes // 2)
    return GlobalOrder(len(train), c.cfg.seed)


def train_loader(c: Components, state: TrainState):
    """This rank's micro-batches from ``state``'s position in the global order to the end."""
    cfg, env = c.cfg, c.env

    def sampler() -> RankBatchSampler:  # an order each: it caches an epoch's permutation
        return RankBatchSampler(train_order(c), global_batch_size=cfg.train.global_batch_size,
                                rank=env.rank, world_size=env.world_size,
                                micro_batch_size=c.micro, start_step=state.step,
                                end_step=cfg.train.max_steps,
                                first_sample=state.samples_consumed)
    _read_ahead(c, state, sampler)
    workers, pin = loader_workers(c)
    return make_loader(c.data.train, sampler(), num_workers=workers, pin_memory=pin,
                       persistent_workers=cfg.data.persistent_workers,
                       prefetch_factor=cfg.data.prefetch_factor, seed=cfg.seed)


def loader_workers(c: Components) -> tuple[int, bool]:
    """(DataLoader worker processes, pin_memory) for this rank: ``data.num_workers`` (auto:
    half the rank's CPUs, at most 4) and ``data.pin_memory`` (auto: on GPU)."""
    workers = c.cfg.data.num_workers
    if workers == AUTO:
        workers = min(4, c.env.cpus_per_rank() // 2)
    pin = c.cfg.data.pin_memory
    return workers, c.device.type == "cuda" if pin == AUTO else pin
