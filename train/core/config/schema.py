"""The configuration schema: one keyword-only dataclass per component, nothing else
(the metrics, console and tracker keys are :mod:`.logging_keys`').

Each field carries its one-line doc and numeric bounds (:func:`~.fields.opt`); the loader
validates against them, and the config reference (docs/config.md) and ``configs/schema.json`` are
generated from them (``python -m train.core.config.reference``). The key names are a contract
with users (docs/architecture.md, "Contracts"): rename one only on purpose.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from train.core.config.fields import AUTO, opt
from train.core.config.kinds import DATA_KIND_NAMES, MODEL_KIND_NAMES
from train.core.config.logging_keys import LoggingConfig


@dataclass(kw_only=True)
class RunConfig:
    name: str | None = opt(None, "Run name; the run directory is output.dir/run.name. "
                                 "Default: the config file's stem, so rerunning a config "
                                 "resumes it.")
    lock_renew_s: float = opt(10.0, "Seconds between renewals of the job's lease on the run "
                                    "directory (RUN_DIR/.lock).", gt=0.0)
    lock_expiry_s: float = opt(60.0, "Seconds without a renewal after which another job may "
                                     "take the lease (>= 2 x run.lock_renew_s).", gt=0.0)
    lock_wait_s: float = opt(300.0, "Seconds a launch waits for another job's live lease "
                                    "(a predecessor's last checkpoint), then exit 6.", ge=0.0)


@dataclass(kw_only=True)
class OutputConfig:
    dir: str = opt("runs", "Directory holding run directories (a mounted volume in containers).")


@dataclass(kw_only=True)
class ModelConfig:
    kind: Literal[MODEL_KIND_NAMES] = opt(  # the kinds of .kinds
        "gpt", "Model family: mlp, cnn (3x32x32 images), gpt (decoder-only transformer), "
               "hf (a transformers causal LM named in model.args; needs the hf extra) or "
               "custom (your own, from model.factory).")
    factory: str | None = opt(None, "custom: import path of a callable returning the "
                                    "torch.nn.Module, 'package.module:name' (a function or a "
                                    "class), importable from the working directory "
                                    "(/workspace in the image) or an installed package.")
    args: dict[str, Any] = opt(dict, "custom: keyword arguments for model.factory (no "
                                     "credentials: a key named like one, password, api_key, "
                                     "hf_token, is refused). hf: exactly one of `config` (a "
                                     "transformers configuration class such as GPT2Config, "
                                     "its model_type such as gpt2, or a local directory with "
                                     "config.json: random init) and `pretrained` (a local "
                                     "save_pretrained directory: its weights, read offline, "
                                     "never downloaded), plus `overrides` (configuration "
                                     "fields to change, e.g. {n_layer: 2}; vocab_size "
                                     "defaults to the data's).", factory=True)
    depth: int = opt(4, "Hidden layers (mlp), conv blocks (cnn) or transformer blocks (gpt).",
                     ge=1, le=256)
    width: int = opt(128, "Hidden size (mlp), base channels (cnn) or embedding size (gpt).",
                     ge=1)
    heads: int = opt(4, "Attention heads (gpt); must divide model.width.", ge=1)
    context_length: int = opt(128, "Tokens per sequence (gpt, hf); also the sample length "
                                   "of text and tokens data.", ge=2)
    dropout: float = opt(0.0, "Dropout probability.", ge=0.0, le=0.9)
    tie_weights: bool = opt(True, "Share the gpt token embedding with the output layer.")


@dataclass(kw_only=True)
class DataConfig:
    kind: Literal[DATA_KIND_NAMES] = opt(
        "text", "synthetic (learnable, from the seed), tensors (.pt/.npy features + labels), "
                "text (bytes of text files), tokens (uint16 memmap .bin) or custom (your own, "
                "from data.factory).")
    factory: str | None = opt(None, "custom: import path of a callable returning a map-style "
                                    "Dataset of (input, target) pairs, or a pair (train, "
                                    "validation) of them.")
    args: dict[str, Any] = opt(dict, "custom: keyword arguments for data.factory (no "
                                     "credentials, as in model.args).", factory=True)
    path: str | list[str] | None = opt(
        None, "tensors: .pt file holding {features, labels} or a .npy features file; text: a "
              "directory (default: the Python standard library's source) or files as for "
              "tokens; tokens: a .bin file, a glob (shards/*.bin), s3://BUCKET/PREFIX/*.bin, "
              "or a list of those: one dataset, files sorted within each entry.")
    labels_path: str | None = opt(None, "tensors: .npy labels when data.path is a .npy file.")
    text_glob: str = opt("**/*.py", "text: which files of a directory data.path, sorted.")
    max_bytes: int = opt(8_000_000, "text: stop reading after this many bytes (0 = all).", ge=0)
    vocab_size: int = opt(50304, "tokens, and custom data with gpt: number of token ids (ids "
                                 "must be below it).", ge=2, le=65536)
    num_samples: int = opt(8192, "synthetic: number of samples.", ge=2)
    shape: list[int] = opt(lambda: [32], "synthetic: shape of one sample, e.g. [32] for mlp, "
                                         "[3, 32, 32] for cnn.", factory=True)
    num_classes: int = opt(10, "synthetic, and custom data with a built-in mlp or cnn: number "
                                "of classes.", ge=2)
    val_fraction: float = opt(0.05, "Fraction of samples held out for validation (the tail "
                                    "of the data, never shuffled into training).", ge=0.0, le=0.5)
    num_workers: int | Literal["auto"] = opt(AUTO, "DataLoader worker processes per rank; "
                                                   "auto follows the CPUs this container may use.",
                                             ge=0)
    persistent_workers: bool = opt(True, "Keep DataLoader workers alive between epochs.")
    pin_memory: bool | Literal["auto"] = opt(AUTO, "Pin host memory for faster copies "
                                                   "(auto: on GPU only).")
    prefetch_factor: int = opt(2, "Batches each worker loads ahead.", ge=1)
    cache_dir: str | None = opt(None, "objects from s3:// (tokens, text, and "
                                      "train.data.remote in custom data): where the fetched "
                                      "files are kept, shared by the ranks of a node "
                                      "(default: TMPDIR/trainpod-data, node-local).")
    cache_bytes: int = opt(64 << 30, "objects from s3://: the most bytes of fetched files kept "
                                     "in data.cache_dir; at least the largest file (the whole "
                                     "dataset to fetch each file once).", ge=1 << 20)
    shuffle: Literal["windows", "blocks"] = opt(
        "windows", "tokens: the training order. windows: every window of every file "
                   "shuffled each epoch (objects bigger together than data.cache_bytes are "
                   "fetched again and again); blocks: the files shuffled each epoch and cut "
                   "into groups of half data.cache_bytes, the windows shuffled within a "
                   "group, so each object is fetched once an epoch by a cache that holds two "
                   "of the largest file.")
    allow_changed: bool = opt(False, "Resume a run whose data differs from what its checkpoint "
                                     "trained on (its data_sha256: files, objects, or the "
                                     "custom factory and args). Off: such a resume is exit 2 "
                                     "naming both hashes.")


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
    fused: bool | Literal["auto"] = opt(AUTO, "The optimizer's fused kernel (one per group "
                                              "instead of one per tensor); auto: on wherever "
                                              "torch has it for the parameters (CPU, CUDA, "
                                              "ROCm).")


@dataclass(kw_only=True)
class ScheduleConfig:
    name: Literal["constant", "cosine", "linear"] = opt("cosine", "Learning-rate decay after "
                                                                   "warmup.")
    warmup_steps: int = opt(0, "Linear warmup from 0 to optim.lr over this many steps; more "
                               "than train.max_steps is shortened to it, with a warning.",
                            ge=0)
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
    loss: str = opt("cross_entropy", "cross_entropy (classes or next tokens), mse "
                                     "(regression), model (the model's own loss: called as "
                                     "model(inputs, labels=targets), its output's `loss`; "
                                     "custom model and data), or the import path of your "
                                     "own fn(outputs, targets) -> scalar tensor. The built-in "
                                     "losses take the logits out of a ModelOutput, a dict "
                                     "or a tuple.")
    nonfinite: Literal["stop", "skip_step"] = opt(
        "stop", "A non-finite loss or gradient norm: stop (exit 4; nothing non-finite is "
                "saved) or skip_step (drop that step's update, at most "
                "train.max_skipped_steps times per run).")
    max_skipped_steps: int = opt(10, "skip_step: updates a run may skip; one more stops it "
                                     "as with stop.", ge=0)
    shutdown_timeout_s: float = opt(30.0, "After the last step and its checkpoint: how long "
                                          "the run's end may wait, in all, for what lies "
                                          "outside it (trackers sending buffered metrics and "
                                          "closing their run, uploads, DataLoader worker "
                                          "processes); then it ends anyway and one line names "
                                          "what it gave up on. A stop signal leaves 2 s.",
                                    ge=0.0)


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
    fault_tolerance: Literal["restart", "replicas"] = opt(
        "restart", "What a lost worker or node costs. restart: every worker restarts and "
                   "resumes from the last checkpoint. replicas: distributed.replicas groups "
                   "train the global batch together and survivors train on through a loss "
                   "(torchft: pip install 'trainpod[ft]'; docs/fault-tolerance.md).")
    replicas: int = opt(2, "fault_tolerance=replicas: the replica groups that share each "
                           "global batch (on one machine, nproc_per_node processes each).",
                        ge=1)
    spares: int = opt(0, "fault_tolerance=replicas: hot spare groups started with the job; "
                         "a spare follows every step and takes a lost group's share.", ge=0)
    replica_timeout_s: float = opt(60.0, "fault_tolerance=replicas: how long a group waits "
                                          "in a step's all-reduce for the other groups; "
                                          "longer than the groups' step times differ. A "
                                          "frozen or cut-off group costs this once.", gt=0.0)
    timeout_s: int = opt(600, "Collective timeout (checkpoint and evaluation collectives "
                              "too); a training step silent for 20 step times (at least "
                              "120 s, at most this) is a hang: stacks dumped, the rank "
                              "named.", ge=10)
    rdzv_join_timeout_s: int = opt(600, "Multi-node: how long nodes wait for the minimum "
                                        "number of nodes before giving up (exit 1); also the "
                                        "static rendezvous' wait (Kubeflow v1).", ge=1)
    rdzv_last_call_s: int = opt(3, "Multi-node elastic: once the minimum is there, how long a "
                                   "round stays open for more nodes. Each second here is a "
                                   "second of standstill after a node is lost.", ge=0)
    rdzv_keep_alive_s: int = opt(2, "Multi-node elastic: heartbeat interval of the rendezvous "
                                    "keep-alives; a node silent for rdzv_keep_alive_s x "
                                    "(rdzv_keep_alive_attempts + 1) seconds whose host does not "
                                    "answer has left the job.", ge=1)
    rdzv_keep_alive_attempts: int = opt(3, "Multi-node elastic: missed heartbeats before a "
                                           "node whose host does not answer counts as gone "
                                           "(one whose host answers: heartbeat_silence_s).",
                                        ge=1)
    rdzv_store_wait_s: int = opt(300, "Multi-node elastic: how long a node waits for a lost "
                                      "rendezvous store to come back (and then re-joins) "
                                      "before it exits 5.", ge=0)
    heartbeat_silence_s: int = opt(20, "Multi-node: how long a node whose host still "
                                       "answers (starved of CPU, paused, frozen) may go "
                                       "without a heartbeat before it counts as lost; a host "
                                       "that vanished is noticed sooner, in "
                                       "rdzv_keep_alive_s x (rdzv_keep_alive_attempts + 1).",
                                       ge=2)
    preflight: Literal["off", "warn", "fail"] = opt(
        "warn", "Multi-node: before step 1 every rank times a fixed matmul on its device, "
                "an all-reduce with its peers and its node's links to a few peer nodes (a "
                "few seconds); rank 0 names a node far slower than the others (its compute "
                "or, with 3 nodes or more, its links) or failing (NaN, an error) and keeps "
                "the numbers in "
                "RUN_DIR/preflight.json. warn: the lines, training goes on; fail: exit 3 "
                "before step 1; off: no check. doctor --comm runs the same check.")
    preflight_slow_ratio: float = opt(0.5, "preflight: a rank whose matmul runs below this "
                                           "fraction of the median rank's, or a node whose "
                                           "fastest link runs below this fraction of the "
                                           "other nodes' (also in a mid-run check), is slow.",
                                      gt=0.0, le=1.0)
    socket_ifname: str | None = opt(None, "Network interface for NCCL and gloo (sets "
                                          "NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME); the "
                                          "TRAIN_SOCKET_IFNAME variable of a node wins.")
    debug: bool = opt(False, "Verbose communication logs: NCCL_DEBUG=INFO, "
                             "TORCH_DISTRIBUTED_DEBUG=DETAIL (also TRAIN_DEBUG=1).")
    grace_period_s: int = opt(120, "Seconds from SIGTERM to SIGKILL on this platform (k8s "
                                   "terminationGracePeriodSeconds, SLURM KillWait): torchrun "
                                   "gives the stop checkpoint this minus 5 s (not 30 s).", ge=6)


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
    async_save: bool = opt(False, "Write checkpoints in the background: training goes on "
                                    "once the state is copied to CPU memory.")
    format: Literal["auto", "full", "sharded"] = opt(
        AUTO, "full: one state.pt with the full tensors, written by rank 0; sharded: each "
              "rank writes its own shards (torch.distributed.checkpoint), resumable at any "
              "world size; auto: sharded for fsdp, full otherwise.")
    remote: str | None = opt(None, "s3://BUCKET/PREFIX: every sealed checkpoint is also "
                                   "uploaded (in the background) under PREFIX/RUN_NAME/, and a "
                                   "resume takes the newest sealed locally or there (pip "
                                   "install 'trainpod[s3]'; credentials from the AWS_* "
                                   "variables and files, never here: docs/object-storage.md).")


@dataclass(kw_only=True)
class Config:
    seed: int = opt(0, "Seeds model init, data order and dropout (0 .. 2^32-1).", ge=0,
                    le=2**32 - 1)
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

    @property
    def run_dir(self) -> Path:
        return Path(self.output.dir) / str(self.run.name)

    @property
    def sharded_checkpoints(self) -> bool:
        """checkpoint.format, with auto decided: sharded for fsdp."""
        fmt = self.checkpoint.format
        return fmt == "sharded" or (fmt == AUTO and self.distributed.strategy == "fsdp")


def to_dict(cfg: Config) -> dict:
    """The config as plain data (what config.yaml and checkpoints record)."""
    return dataclasses.asdict(cfg)
