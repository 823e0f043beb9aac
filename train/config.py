"""Typed training configuration: one keyword-only dataclass per component.

The YAML file and ``dotted.key=value`` overrides are validated strictly against these
dataclasses: unknown keys (with the closest valid key), wrong types and out-of-range
values all raise :class:`ConfigError`, which the commands turn into exit code 2.
This module never imports torch, so the launcher can validate a config in a
fraction of a second before it starts any worker.

The key names shared across components are a contract (DESIGN.md); the README's
config reference and ``configs/schema.json`` are generated from the field docs here.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from train.errors import ConfigError

AUTO = "auto"
# Token files up to this size are scanned for ids >= data.vocab_size before training
# (about a second per GiB); larger ones are checked batch by batch.
TOKEN_SCAN_LIMIT = 2 << 30


def opt(default: Any, doc: str, *, ge: float | None = None, gt: float | None = None,
        le: float | None = None, factory: bool = False) -> Any:
    """A config field with its one-line doc and optional numeric bounds."""
    meta = {"doc": doc, "ge": ge, "gt": gt, "le": le}
    if factory:
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(kw_only=True)
class RunConfig:
    name: str | None = opt(None, "Run name; the run directory is output.dir/run.name. "
                                 "Default: the config file's stem, so rerunning a config resumes it.")


@dataclass(kw_only=True)
class OutputConfig:
    dir: str = opt("runs", "Directory holding run directories (a mounted volume in containers).")


@dataclass(kw_only=True)
class ModelConfig:
    kind: Literal["mlp", "cnn", "gpt"] = opt("gpt", "Model family: mlp, cnn (3x32x32 images) "
                                                    "or gpt (decoder-only transformer).")
    depth: int = opt(4, "Hidden layers (mlp), conv blocks (cnn) or transformer blocks (gpt).",
                     ge=1, le=256)
    width: int = opt(128, "Hidden size (mlp), base channels (cnn) or embedding size (gpt).",
                     ge=1)
    heads: int = opt(4, "Attention heads (gpt); must divide model.width.", ge=1)
    context_length: int = opt(128, "Tokens per sequence (gpt); also the sample length of "
                                   "text and tokens data.", ge=2)
    dropout: float = opt(0.0, "Dropout probability.", ge=0.0, le=0.9)
    tie_weights: bool = opt(True, "Share the gpt token embedding with the output layer.")


@dataclass(kw_only=True)
class DataConfig:
    kind: Literal["synthetic", "tensors", "text", "tokens"] = opt(
        "text", "synthetic (learnable, from the seed), tensors (.pt/.npy features + labels), "
                "text (bytes of text files) or tokens (uint16 memmap .bin).")
    path: str | None = opt(None, "tensors: .pt file holding {features, labels} or a .npy "
                                 "features file; text: a directory of text files (default: the "
                                 "Python standard library's source); tokens: the .bin file.")
    labels_path: str | None = opt(None, "tensors: .npy labels when data.path is a .npy file.")
    text_glob: str = opt("**/*.py", "text: which files under data.path to read, in sorted order.")
    max_bytes: int = opt(8_000_000, "text: stop reading after this many bytes (0 = all).", ge=0)
    vocab_size: int = opt(50304, "tokens: number of token ids (ids must be below it).",
                          ge=2, le=65536)
    num_samples: int = opt(8192, "synthetic: number of samples.", ge=2)
    shape: list[int] = opt(lambda: [32], "synthetic: shape of one sample, e.g. [32] for mlp, "
                                         "[3, 32, 32] for cnn.", factory=True)
    num_classes: int = opt(10, "synthetic: number of classes.", ge=2)
    val_fraction: float = opt(0.05, "Fraction of samples held out for validation (the tail "
                                    "of the data, never shuffled into training).", ge=0.0, le=0.5)
    num_workers: int | Literal["auto"] = opt(AUTO, "DataLoader worker processes per rank; "
                                                   "auto follows the CPUs this container may use.",
                                             ge=0)
    persistent_workers: bool = opt(True, "Keep DataLoader workers alive between epochs.")
    pin_memory: bool | Literal["auto"] = opt(AUTO, "Pin host memory for faster copies "
                                                   "(auto: on GPU only).")
    prefetch_factor: int = opt(2, "Batches each worker loads ahead.", ge=1)


@dataclass(kw_only=True)
class OptimConfig:
    name: Literal["adamw", "sgd"] = opt("adamw", "Optimizer.")
    lr: float = opt(3e-4, "Peak learning rate.", gt=0.0, le=10.0)
    weight_decay: float = opt(0.0, "Decoupled weight decay (adamw) or L2 (sgd).", ge=0.0)
    betas: list[float] = opt(lambda: [0.9, 0.95], "adamw betas [beta1, beta2].", factory=True)
    eps: float = opt(1e-8, "adamw epsilon.", gt=0.0)
    momentum: float = opt(0.9, "sgd momentum.", ge=0.0, le=1.0)
    grad_clip: float = opt(1.0, "Clip the global gradient norm to this value (0 = off).",
                           ge=0.0)


@dataclass(kw_only=True)
class ScheduleConfig:
    name: Literal["constant", "cosine", "linear"] = opt("cosine", "Learning-rate decay after "
                                                                   "warmup.")
    warmup_steps: int = opt(0, "Linear warmup from 0 to optim.lr over this many steps.", ge=0)
    min_lr_ratio: float = opt(0.1, "Final learning rate as a fraction of optim.lr "
                                   "(cosine, linear).", ge=0.0, le=1.0)


@dataclass(kw_only=True)
class TrainLoopConfig:
    max_steps: int = opt(1000, "Optimizer steps to train for.", ge=1)
    global_batch_size: int = opt(64, "Samples per optimizer step over all ranks; fixed "
                                     "whatever the world size.", ge=1)
    micro_batch_size: int | Literal["auto"] = opt(AUTO, "Samples per forward pass per rank; "
                                                        "gradient accumulation makes up the rest. "
                                                        "auto: global_batch_size / world size.",
                                                  ge=1)
    eval_every_steps: int = opt(0, "Evaluate on the validation split every N steps and at the "
                                   "end (0 = only at the end).", ge=0)
    eval_batches: int = opt(8, "Validation size per evaluation, in global batches: the first "
                               "eval_batches x global_batch_size validation samples (0 = none).",
                            ge=0)


@dataclass(kw_only=True)
class DistributedConfig:
    strategy: Literal["single", "dp", "ddp", "fsdp"] = opt(
        "ddp", "Parallelism: single (one process), dp (DataParallel), ddp or fsdp. ddp with one "
               "process trains unwrapped.")
    backend: Literal["auto", "nccl", "gloo", "mpi"] = opt(
        AUTO, "Process-group backend; auto: nccl on CUDA/ROCm (RCCL), gloo on CPU.")
    nproc_per_node: int | Literal["auto"] = opt(AUTO, "Processes per node; auto: one per "
                                                      "usable GPU, 1 on CPU.", ge=1)
    max_restarts: int = opt(3, "torchrun restarts of the local workers after a failure.", ge=0)
    timeout_s: int = opt(600, "Collective timeout; a rank stuck this long dumps its stacks "
                              "and fails.", ge=10)
    socket_ifname: str | None = opt(None, "Network interface for NCCL and gloo (sets "
                                          "NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME); the "
                                          "TRAIN_SOCKET_IFNAME variable of a node wins.")
    debug: bool = opt(False, "Verbose communication logs: NCCL_DEBUG=INFO, "
                             "TORCH_DISTRIBUTED_DEBUG=DETAIL (also TRAIN_DEBUG=1).")


@dataclass(kw_only=True)
class MemoryConfig:
    activation_checkpointing: Literal["none", "full", "every_n"] = opt(
        "none", "Recompute activations in backward: none, full (every block) or every_n.")
    activation_checkpointing_n: int = opt(2, "every_n: checkpoint every n-th block.", ge=1)
    cpu_offload: bool = opt(False, "fsdp: keep parameters and optimizer state on the CPU.")


@dataclass(kw_only=True)
class CheckpointConfig:
    every_steps: int = opt(0, "Save a checkpoint every N steps and at the end (0 = only at the "
                              "end and on SIGTERM).", ge=0)
    keep_last: int = opt(3, "Checkpoints to keep.", ge=1)
    resume_from: str = opt(AUTO, "auto (newest valid checkpoint of this run), none (start "
                                 "over; earlier checkpoints are moved to "
                                 "checkpoints.replaced-<time>/), or a checkpoint directory.")
    async_save: bool = opt(False, "Write checkpoints in the background.")


@dataclass(kw_only=True)
class LoggingConfig:
    every_steps: int = opt(10, "Console line, metrics.jsonl row and TensorBoard scalars every "
                               "N steps.", ge=1)
    progress: Literal["auto", "bar", "plain"] = opt(AUTO, "Console style; auto: a live bar on "
                                                          "a terminal, plain lines otherwise.")
    tensorboard: bool = opt(True, "Write TensorBoard events to the run's tb/ directory.")


@dataclass(kw_only=True)
class Config:
    seed: int = opt(0, "Seeds model init, data order and dropout.", ge=0)
    deterministic: bool = opt(False, "Deterministic algorithms everywhere PyTorch has them.")
    device: Literal["auto", "gpu", "cpu"] = opt(AUTO, "auto: GPUs when usable, else CPU.")
    precision: Literal["fp32", "bf16", "fp16"] = opt("fp32", "fp32, bf16 autocast, or fp16 "
                                                             "autocast with a gradient scaler.")
    compile: bool = opt(False, "torch.compile the model.")
    run: RunConfig = opt(RunConfig, "Run identity.", factory=True)
    output: OutputConfig = opt(OutputConfig, "Where runs are written.", factory=True)
    model: ModelConfig = opt(ModelConfig, "Model architecture.", factory=True)
    data: DataConfig = opt(DataConfig, "Dataset and loading.", factory=True)
    optim: OptimConfig = opt(OptimConfig, "Optimizer.", factory=True)
    schedule: ScheduleConfig = opt(ScheduleConfig, "Learning-rate schedule.", factory=True)
    train: TrainLoopConfig = opt(TrainLoopConfig, "Training loop.", factory=True)
    distributed: DistributedConfig = opt(DistributedConfig, "Processes and communication.",
                                         factory=True)
    memory: MemoryConfig = opt(MemoryConfig, "Memory savers.", factory=True)
    checkpoint: CheckpointConfig = opt(CheckpointConfig, "Checkpoints.", factory=True)
    logging: LoggingConfig = opt(LoggingConfig, "Metrics and console.", factory=True)

    source: typing.ClassVar[str] = "config"

    @property
    def run_dir(self) -> Path:
        return Path(self.output.dir) / str(self.run.name)


# --------------------------------------------------------------------------- parsing

def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[tp]


_NO = object()


def _coerce_scalar(value: Any, tp: Any, from_cli: bool) -> Any:
    """Return value converted to tp, or _NO when it does not fit."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return value if value in typing.get_args(tp) else _NO
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(tp):
            got = _coerce_scalar(value, arm, from_cli)
            if got is not _NO:
                return got
        return _NO
    if origin is list:
        if not isinstance(value, list):
            return _NO
        items = [_coerce_scalar(v, typing.get_args(tp)[0], from_cli) for v in value]
        return _NO if any(i is _NO for i in items) else items
    if tp is type(None):
        return None if value is None else _NO
    if tp is bool:
        return value if isinstance(value, bool) else _NO
    if tp is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _NO
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
            try:
                return float(value)
            except ValueError:
                return _NO
        return _NO
    if tp is str:
        if isinstance(value, str):
            return value
        # An override like run.name=2024 arrives as an int; as a string it is meant.
        if from_cli and isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        return _NO
    raise TypeError(f"unsupported config type {tp!r}")


def _check_bounds(value: Any, meta: Any) -> str | None:
    values = value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if meta.get("ge") is not None and v < meta["ge"]:
            return f"must be >= {meta['ge']}"
        if meta.get("gt") is not None and v <= meta["gt"]:
            return f"must be > {meta['gt']}"
        if meta.get("le") is not None and v > meta["le"]:
            return f"must be <= {meta['le']}"
    return None


def _unknown_key(source: str, prefix: str, key: str, valid: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"did you mean {prefix}{close[0]}?" if close else "valid keys: " + ", ".join(valid)
    return ConfigError(source, prefix + key, f"unknown key; {hint}")


def _build(cls: type, data: Any, source: str, prefix: str, from_cli: dict[str, bool]) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(source, prefix.rstrip(".") or "<top>",
                          f"must be a mapping, got {type(data).__name__}")
    types_ = field_types(cls)
    fields_ = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        key = str(key)
        if key not in types_:
            raise _unknown_key(from_cli_source(source, prefix + key, from_cli), prefix, key,
                               list(types_))
        dotted = prefix + key
        tp = types_[key]
        if _is_dataclass_type(tp):
            kwargs[key] = _build(tp, value if value is not None else {}, source,
                                 dotted + ".", from_cli)
            continue
        got = _coerce_scalar(value, tp, from_cli.get(dotted, False))
        if got is _NO:
            raise ConfigError(from_cli_source(source, dotted, from_cli), dotted,
                              f"got {value!r}; expected {_describe(tp)}")
        problem = _check_bounds(got, fields_[key].metadata)
        if problem:
            raise ConfigError(from_cli_source(source, dotted, from_cli), dotted,
                              f"got {value!r}; {problem}")
        kwargs[key] = got
    return cls(**kwargs)


def from_cli_source(source: str, dotted: str, from_cli: dict[str, bool]) -> str:
    return "command line" if from_cli.get(dotted) else source


def parse_override(text: str, source: str = "command line") -> tuple[str, Any]:
    """Split ``a.b=value``; the value is read as YAML (so ``[1, 2]``, ``true``, ``null``)."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(source, text, "overrides look like dotted.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def _set_dotted(tree: dict, key: str, value: Any, source: str) -> None:
    node = tree
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(source, ".".join(parts[: i + 1]), "is a value, not a section")
        node = child
    node[parts[-1]] = value


def read_yaml(path: str | Path) -> dict:
    """Read a config file with yaml.safe_load; every failure is a ConfigError."""
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(source, "<file>", "no such file") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise ConfigError(source, "<file>", f"cannot read: {exc.__class__.__name__}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "<file>"
        raise ConfigError(source, where, f"invalid YAML: {getattr(exc, 'problem', exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(source, "<top>", "the file must hold a mapping of keys")
    return data


def load_config(path: str | Path, overrides: list[str] = ()) -> Config:
    """Load, override, validate. Raises ConfigError (exit 2) on anything invalid."""
    source = str(path)
    tree = read_yaml(path)
    from_cli: dict[str, bool] = {}
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(tree, key, value, "command line")
        from_cli[key] = True
    cfg = _build(Config, tree, source, "", from_cli)
    if cfg.run.name is None:
        cfg.run.name = Path(path).stem
    validate(cfg, source, from_cli)
    cfg.source = source  # not a field: where later errors (e.g. per world size) point
    return cfg


def config_from_dict(tree: dict, source: str = "<dict>") -> Config:
    """Rebuild a Config from its resolved dict (config.yaml of a run, a checkpoint)."""
    cfg = _build(Config, tree, source, "", {})
    validate(cfg, source, {})
    return cfg


# ------------------------------------------------------------------------ validation

def validate(cfg: Config, source: str, from_cli: dict[str, bool] | None = None) -> None:
    """Checks that span several keys, plus files that must exist."""
    from_cli = from_cli or {}

    def fail(key: str, problem: str, *related: str) -> None:
        """related: other keys of a cross-key check; any of them from the command line
        makes the command line the source."""
        from_cmdline = any(from_cli.get(k) for k in (key, *related))
        raise ConfigError("command line" if from_cmdline else source, key, problem)

    m, d, t = cfg.model, cfg.data, cfg.train
    if not cfg.run.name or "/" in cfg.run.name or cfg.run.name in (".", ".."):
        fail("run.name", f"got {cfg.run.name!r}; a non-empty name without '/'")
    if m.kind == "gpt":
        if m.width % m.heads:
            fail("model.heads", f"{m.heads} does not divide model.width={m.width}", "model.width")
        if d.kind not in ("text", "tokens"):
            fail("data.kind", f"model.kind gpt needs text or tokens data, got {d.kind}",
                 "model.kind")
    elif d.kind in ("text", "tokens"):
        fail("data.kind", f"{d.kind} data needs model.kind gpt, got {m.kind}", "model.kind")
    if m.kind == "cnn" and d.kind == "synthetic" and len(d.shape) != 3:
        fail("data.shape", f"cnn needs [channels, height, width], got {d.shape}", "model.kind")
    if not d.shape or any(s < 1 for s in d.shape):
        fail("data.shape", f"got {d.shape}; a list of positive sizes")
    if len(cfg.optim.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.optim.betas):
        fail("optim.betas", f"got {cfg.optim.betas}; two numbers in [0, 1)")
    if cfg.schedule.warmup_steps > t.max_steps:
        fail("schedule.warmup_steps", f"{cfg.schedule.warmup_steps} exceeds "
                                      f"train.max_steps={t.max_steps}", "train.max_steps")
    if t.micro_batch_size != AUTO and t.global_batch_size % t.micro_batch_size:
        fail("train.micro_batch_size", f"{t.micro_batch_size} does not divide "
                                       f"train.global_batch_size={t.global_batch_size}",
             "train.global_batch_size")
    if cfg.memory.activation_checkpointing != "none" and m.kind != "gpt":
        fail("memory.activation_checkpointing", f"applies to gpt blocks; model.kind is {m.kind}",
             "model.kind")
    if cfg.memory.cpu_offload and cfg.distributed.strategy != "fsdp":
        fail("memory.cpu_offload", "needs distributed.strategy=fsdp", "distributed.strategy")
    _validate_data_paths(cfg, fail)
    resume = cfg.checkpoint.resume_from
    if resume not in (AUTO, "none") and not (Path(resume) / "checksums.json").is_file():
        fail("checkpoint.resume_from", f"{resume}: not a checkpoint directory (no "
                                       f"checksums.json); use auto, none or a step-N directory")


def _validate_data_paths(cfg: Config, fail) -> None:
    d = cfg.data
    if d.kind == "synthetic":
        return
    if d.kind in ("tensors", "tokens") and not d.path:
        fail("data.path", f"required for data.kind={d.kind}")
    if d.path is None:
        return  # text: the standard library's source
    path = Path(d.path)
    if d.kind == "text":
        if not path.is_dir():
            fail("data.path", f"{d.path}: not a directory")
        return
    if not path.is_file():
        fail("data.path", f"{d.path}: no such file")
    if d.kind == "tokens":
        size = path.stat().st_size
        if size < 4 or size % 2:
            fail("data.path", f"{d.path}: not a uint16 token file (odd or tiny size)")
        if size <= TOKEN_SCAN_LIMIT:  # larger files are checked batch by batch
            import numpy as np
            top = int(np.memmap(path, dtype=np.uint16, mode="r").max())
            if top >= d.vocab_size:
                fail("data.vocab_size", f"{d.vocab_size} but {d.path} holds token id {top}; "
                                        f"set data.vocab_size to at least {top + 1}")
        return
    if path.suffix not in (".pt", ".npy"):
        fail("data.path", f"{d.path}: expected a .pt or .npy file")
    if path.suffix == ".npy":
        if not d.labels_path:
            fail("data.labels_path", "required when data.path is a .npy file")
        if not Path(d.labels_path).is_file():
            fail("data.labels_path", f"{d.labels_path}: no such file")


# ----------------------------------------------------------------------- serialising

def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def default_text_root() -> str:
    """The standard library's source directory: real text on every machine, no download."""
    import sysconfig
    return sysconfig.get_paths()["stdlib"]


def batch_split(cfg: Config, world_size: int) -> tuple[int, int]:
    """(micro_batch_size, gradient accumulation steps) that keep global_batch_size.

    global = world_size x micro x accum must hold exactly; anything else is a
    ConfigError naming the world size, so the launcher can check every size in
    MIN..MAX before starting workers.
    """
    t, source = cfg.train, cfg.source
    if t.global_batch_size % world_size:
        raise ConfigError(source, "train.global_batch_size",
                          f"{t.global_batch_size} is not divisible by world size {world_size}; "
                          f"use a multiple of {world_size}")
    per_rank = t.global_batch_size // world_size
    micro = per_rank if t.micro_batch_size == AUTO else t.micro_batch_size
    if per_rank % micro:
        raise ConfigError(source, "train.micro_batch_size",
                          f"{micro} does not divide the per-rank batch {per_rank} "
                          f"(train.global_batch_size={t.global_batch_size} / world size "
                          f"{world_size}); choose a divisor of {per_rank}")
    return micro, per_rank // micro


# Keys whose change makes a run's checkpoints unloadable (parameter or optimizer-state
# shapes, or what the inputs mean).
RESUME_KEYS = ("model.kind", "model.depth", "model.width", "model.heads", "model.context_length",
               "model.tie_weights", "data.kind", "data.vocab_size", "data.shape",
               "data.num_classes", "optim.name")


def _dig(tree: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree.get(part, {}) if isinstance(tree, dict) else {}
    return tree


def check_checkpoint_config(cfg: Config, saved: dict, where: Path | str) -> None:
    """ConfigError (exit 2) naming the first resume key that differs from `saved` (the
    resolved config a run or checkpoint was written with)."""
    new = to_dict(cfg)
    changed = [f"{key} {_dig(saved, key)!r} -> {_dig(new, key)!r}" for key in RESUME_KEYS
               if _dig(saved, key) != _dig(new, key)]
    if changed:
        raise ConfigError(cfg.source, changed[0].split()[0],
                          f"differs from the run being resumed ({where}: "
                          f"{'; '.join(changed[:3])}); use a new run.name, or "
                          f"checkpoint.resume_from=none to start this run over")


def check_resume_compatible(cfg: Config) -> None:
    """A config that would resume a run whose checkpoints it cannot load is bad input.

    Before any worker starts: compares with the run directory's config.yaml (written
    once a start has loaded its checkpoint, so it matches the checkpoints' shapes).
    The worker checks the checkpoint's own copy again when it loads it.
    """
    run_dir = cfg.run_dir
    if cfg.checkpoint.resume_from != AUTO or not (run_dir / "checkpoints" / "latest").exists():
        return
    try:
        saved = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return  # nothing to compare with; the worker checks the checkpoint itself
    check_checkpoint_config(cfg, saved, run_dir)
