"""Checks beyond single values: keys that must agree, files that must exist, how the
global batch splits over a world size, and whether a batch and a model fit in memory.
Whether a run's checkpoints still fit the config is :mod:`.resume`'s.

Each failure is a :class:`ConfigError` (exit 2) naming the key and where its value
came from (and where each other value it quotes came from); :func:`validate` reports
every failure at once; each model and data kind brings its own rules
(:mod:`.kinds`). Torch-free; the token scan imports numpy only when it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from train.core.config import kinds
from train.core.config.origins import (
    DEFAULT,
    QUOTED,
    Sources,
    dig,
    ref,
    related,
    show,
    source_of,
    val,
)
from train.core.config.schema import AUTO, Config, to_dict
from train.core.config.strict_yaml import short
from train.core.errors import CannotRunHere, ConfigError, raise_all
from train.core.run import rundir
from train.core.storage import credentials, urls


def validate(cfg: Config, sources: Sources, errors: list[ConfigError] | None = None,
             bad: set[str] = frozenset()) -> None:
    """Checks that span several keys, plus files that must exist.

    Each failure names the key and where its value came from; any other value it
    quotes says where it came from when that differs (``train.max_steps=10 (command
    line)``, ``model.width=128 (default)``). Failures are added to ``errors`` (raised
    at the end without it); a check that reads a key in ``bad`` (one that already
    failed on its own and holds its default instead) is skipped. A warmup longer than
    the run is shortened to it, with a warning (:func:`~.loader.config_warnings`).
    """
    collect = errors is not None
    report = _Report(cfg, sources, [] if errors is None else errors, bad)
    # the checks run in this order, and their errors are reported in it
    _refuse_credentials(cfg, report)
    _check_run(cfg, report.fail)
    kinds.check_pairing(cfg, report.fail)
    _check_lists(cfg, report.fail)
    _shorten_warmup(cfg, report.warn)
    _check_batch_and_memory(cfg, report.fail)
    _check_data_files(cfg, report)
    _check_resume_from(cfg, report.fail)
    _check_remote(cfg, report.fail)
    _check_shuffle(cfg, report.fail)
    _check_replicas(cfg, report)
    cfg._warnings = report.warnings
    if not collect:
        raise_all(report.errors)


class _Report:
    """What :func:`validate` found: failures (``errors``) and warnings, each message
    quoting values with their origins; a check that reads a key in ``bad`` says nothing."""

    def __init__(self, cfg: Config, sources: Sources, errors: list[ConfigError],
                 bad: set[str]) -> None:
        self.cfg, self.sources, self.errors, self.bad = cfg, sources, errors, bad
        self.warnings: list[str] = []

    def is_bad(self, key: str) -> bool:
        return any(related(key, b) for b in self.bad)

    def fail(self, key: str, problem: str, *related: str) -> None:
        """related: keys the check reads besides those quoted with ref() / val()."""
        error = self._say(key, problem, related)
        if error is not None:
            self.errors.append(error)

    def warn(self, key: str, problem: str, *related: str) -> bool:
        error = self._say(key, problem, related)
        if error is not None:
            self.warnings.append(str(error))
        return error is not None

    def _say(self, key: str, problem: str, related: tuple[str, ...]) -> ConfigError | None:
        """The message with each quoted value's origin, or None when it reads a bad key."""
        mentioned = QUOTED.findall(problem)
        if any(self.is_bad(k) for k in (key, *related, *(name for _, name in mentioned))):
            return None
        sources = self.sources
        line_source = sources.of(key)

        def expand(match) -> str:
            kind, name = match.groups()
            note = (" (default)" if sources.origin(name) == DEFAULT else "") if name == key \
                else sources.note(name, line_source)
            shown = show(dig(to_dict(self.cfg), name))
            return f"{shown}{note}" if kind == "v" else f"{name}={shown}{note}"
        return ConfigError(line_source, key, QUOTED.sub(expand, problem))


def _refuse_credentials(cfg: Config, report: _Report) -> None:
    """A credential in any value (a URL's ``user:token@``, a ``model.args.hf_token``): the
    config is copied into files, checkpoints, trackers and argv, so it is refused, naming
    the environment variable it goes in instead; no other check reads that key."""
    for key, what in credentials.found(to_dict(cfg)):
        report.fail(key, credentials.problem(key, what))
        report.bad = {*report.bad, key}


def _check_run(cfg: Config, fail: kinds.Fail) -> None:
    """The run's name and lease, and the folder its run directory goes in."""
    name = cfg.run.name
    if not name or "/" in name or name in (".", "..") or not name.isprintable():
        fail("run.name", f"got {short(name)}; a non-empty name without '/' or control "
                         "characters")
    if cfg.run.lock_expiry_s < 2 * cfg.run.lock_renew_s:
        fail("run.lock_expiry_s", f"{val('run.lock_expiry_s')} is less than twice "
                                  f"{ref('run.lock_renew_s')}: one late renewal would expire "
                                  "the lease")
    if not cfg.output.dir.strip():
        fail("output.dir", "is empty; a directory for run directories, e.g. runs")
    if 0 < cfg.logging.straggler_ratio <= 1:
        fail("logging.straggler_ratio", f"{val('logging.straggler_ratio')} would call every "
                                        "rank slow; more than 1 (e.g. 1.3), or 0 for off")


def _check_lists(cfg: Config, fail: kinds.Fail) -> None:
    """data.shape's sizes and optim.betas' pair."""
    if not cfg.data.shape or any(s < 1 for s in cfg.data.shape):
        fail("data.shape", f"got {cfg.data.shape}; a list of positive sizes")
    if len(cfg.optim.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.optim.betas):
        fail("optim.betas", f"got {cfg.optim.betas}; two numbers in [0, 1)")


def _shorten_warmup(cfg: Config, warn: Callable[..., bool]) -> None:
    """A warmup longer than the run becomes the whole run, with a warning."""
    t = cfg.train
    if cfg.schedule.warmup_steps > t.max_steps and warn(
            "schedule.warmup_steps", f"{val('schedule.warmup_steps')} exceeds "
                                     f"{ref('train.max_steps')}; warmup shortened to "
                                     f"{t.max_steps} steps (the whole run)"):
        cfg.schedule.warmup_steps = t.max_steps


def _check_batch_and_memory(cfg: Config, fail: kinds.Fail) -> None:
    """The micro-batch against the global batch; the memory options against the model
    kind and the strategy."""
    t = cfg.train
    if t.micro_batch_size != AUTO and t.global_batch_size % t.micro_batch_size:
        fail("train.micro_batch_size", f"{val('train.micro_batch_size')} does not divide "
                                       f"{ref('train.global_batch_size')}")
    if cfg.memory.activation_checkpointing != "none" and not kinds.model_kind(cfg).blocks:
        fail("memory.activation_checkpointing", f"applies to the blocks of "
                                                f"{_blocked_kinds()} models, got "
                                                f"{ref('model.kind')}")
    if cfg.memory.cpu_offload and cfg.distributed.strategy != "fsdp":
        fail("memory.cpu_offload", f"needs distributed.strategy=fsdp, got "
                                   f"{ref('distributed.strategy')}")


def _check_data_files(cfg: Config, report: _Report) -> None:
    """The data files: after any other problem of the data keys is fixed."""
    if report.is_bad("data") or report.is_bad("model.context_length") or \
            report.is_bad("model.kind"):
        return
    try:
        kinds.data_kind(cfg).files(cfg, report.fail)
    except ConfigError as exc:  # from train.core.datasets.datafiles: names the data file itself
        report.errors.append(exc)


def _check_resume_from(cfg: Config, fail: kinds.Fail) -> None:
    """A checkpoint directory given by path must be one (auto and none need nothing)."""
    resume = cfg.checkpoint.resume_from
    if resume not in (AUTO, "none") and not (Path(resume) / rundir.CHECKSUMS).is_file():
        fail("checkpoint.resume_from", f"{resume}: not a checkpoint directory (no "
                                       f"checksums.json); use auto, none or a step-N directory")


def _check_remote(cfg: Config, fail: kinds.Fail) -> None:
    """checkpoint.remote: empty (off) or an s3://BUCKET/PREFIX URL."""
    if cfg.checkpoint.remote:
        _, problem = urls.parse(cfg.checkpoint.remote)
        if problem:
            fail("checkpoint.remote", problem)


def _check_shuffle(cfg: Config, fail: kinds.Fail) -> None:
    """data.shuffle: blocks keeps the windows of a few files together: token files only."""
    if cfg.data.shuffle == "blocks" and cfg.data.kind != "tokens":
        fail("data.shuffle", f"blocks orders the files of data.kind=tokens; "
                             f"{ref('data.kind')} is shuffled by windows")


REPLICA_KEYS = ("distributed.replicas", "distributed.spares", "distributed.replica_timeout_s")


def _check_replicas(cfg: Config, report: _Report) -> None:
    """distributed.replicas and spares mean something with fault_tolerance=replicas only,
    which trains one process, DDP or FSDP (without CPU offload) inside each group."""
    d = cfg.distributed
    if d.fault_tolerance != "replicas":
        # by value, not origin: print-config writes every key, and its output must load
        for key in REPLICA_KEYS:
            if dig(to_dict(cfg), key) != dig(to_dict(Config()), key):
                report.fail(key, f"applies to distributed.fault_tolerance=replicas, got "
                                 f"{ref('distributed.fault_tolerance')}")
        return
    if d.strategy not in ("single", "ddp", "fsdp"):
        report.fail("distributed.strategy", f"{val('distributed.strategy')} inside replica "
                                            "groups is not supported yet; single, ddp or fsdp")
    elif d.strategy == "fsdp" and cfg.memory.cpu_offload:
        report.fail("memory.cpu_offload",
                    f"{val('memory.cpu_offload')} with {ref('distributed.fault_tolerance')} is "
                    "not supported yet (replica groups do not sum offloaded gradient "
                    "shards); set it to false, or use distributed.fault_tolerance=restart",
                    "distributed.strategy")


def _blocked_kinds() -> str:
    names = [k.name for k in kinds.MODEL_KINDS.values() if k.blocks]
    return " or ".join(names)


def batch_split(cfg: Config, world_size: int, source: str) -> tuple[int, int]:
    """(micro_batch_size, gradient accumulation steps) that keep global_batch_size.

    global = world_size x micro x accum must hold exactly; anything else is a
    ConfigError naming the world size, so the launcher can check every size in
    MIN..MAX before starting workers. ``source``: the config file, for the message
    (the command line instead for a value an override set).
    """
    t = cfg.train
    if t.global_batch_size % world_size:
        raise ConfigError(source_of(cfg, "train.global_batch_size", source),
                          "train.global_batch_size",
                          f"{t.global_batch_size} is not divisible by world size {world_size}; "
                          f"use a multiple of {world_size}")
    per_rank = t.global_batch_size // world_size
    micro = per_rank if t.micro_batch_size == AUTO else t.micro_batch_size
    if per_rank % micro:
        raise ConfigError(source_of(cfg, "train.micro_batch_size", source),
                          "train.micro_batch_size",
                          f"{micro} does not divide the per-rank batch {per_rank} "
                          f"(train.global_batch_size={t.global_batch_size} / world size "
                          f"{world_size}); choose a divisor of {per_rank}")
    return micro, per_rank // micro


# Python's list of the step's sample indices costs about this much per sample.
INDEX_BYTES = 40
# A batch that would not fit even in this much memory is bad input on any machine.
ANY_MACHINE_BYTES = 1 << 40


def sample_bytes(cfg: Config) -> int | None:
    """Bytes of one training sample as the loader hands it over (inputs + target);
    None when only the data file knows (tensors, custom)."""
    return kinds.data_kind(cfg).sample_bytes(cfg)


def check_batch_memory(cfg: Config, world_size: int, source: str,
                       available: int | None) -> None:
    """The samples of one step on one rank (the step's index list plus one micro-batch
    of inputs) must fit in memory: a ConfigError when they would fit nowhere, a
    CannotRunHere when not on this machine (``available`` bytes)."""
    micro, _ = batch_split(cfg, world_size, source)
    per_sample = sample_bytes(cfg)
    need = cfg.train.global_batch_size * INDEX_BYTES + micro * (per_sample or 0)
    arithmetic = (f"train.global_batch_size={cfg.train.global_batch_size} x {INDEX_BYTES} B of "
                  "sample indices" + (f" + a micro-batch of {micro} x {per_sample} B"
                                      if per_sample else "") + f" = {need / 2**30:.1f} GiB")
    if need > ANY_MACHINE_BYTES:
        raise ConfigError(source_of(cfg, "train.global_batch_size", source),
                          "train.global_batch_size",
                          f"{arithmetic} per rank and step, more than any machine holds; "
                          "use a smaller batch")
    if available is not None and need > available // 2:
        raise CannotRunHere(f"train.global_batch_size: {arithmetic} per rank and step, over "
                            f"half of the {available / 2**30:.1f} GiB of memory available "
                            "here; use a smaller global or micro batch")


# fp32 weights + gradients + optimizer state, bytes per parameter (AdamW keeps two
# moments, SGD with momentum one)
STATE_BYTES = {"adamw": 16, "sgd": 12}


def check_model_memory(cfg: Config, world_size: int, available: int | None,
                       where: str, gpu: bool) -> None:
    """CannotRunHere (exit 3) when the model's weights, gradients and optimizer state
    alone exceed ``available`` bytes per process (``where``: which memory), before any
    worker tries and is killed for it. Activations come on top: this is a floor."""
    params = kinds.model_kind(cfg).parameters(cfg)
    if params is None or available is None:
        return
    per_param = STATE_BYTES.get(cfg.optim.name, 16)
    shards = world_size if cfg.distributed.strategy == "fsdp" else 1
    need = params * per_param / shards
    if need <= available:
        return
    split = f", sharded over {shards} processes" if shards > 1 else ""
    fixes = ["a smaller model", "distributed.strategy=fsdp across more "
             + ("GPUs" if gpu else "machines")]
    if gpu and cfg.distributed.strategy == "fsdp" and not cfg.memory.cpu_offload:
        fixes.append("memory.cpu_offload=true")
    raise CannotRunHere(
        f"model: {params / 1e9:.2f} G parameters ({_model_keys(cfg)}); their fp32 weights, "
        f"gradients and {cfg.optim.name} state alone take {need / 2**30:.1f} GiB per process "
        f"({per_param} B a parameter{split}), more than the {available / 2**30:.1f} GiB of "
        f"{where}; use {', or '.join(fixes)}")


def _model_keys(cfg: Config) -> str:
    m = cfg.model
    keys = {"model.width": m.width, "model.depth": m.depth}
    return ", ".join(f"{k}={v}" for k, v in keys.items())
