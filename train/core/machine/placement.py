"""Rules about where a run's processes go, shared by the launcher's plan and the worker:
which backend a device gets, which strategies run one process, which settings need a GPU.

The launcher applies them before anything starts (exit 2 or 3); the worker applies
the same rules again, so ``python -m train`` and a bare ``torchrun`` give the same
answers. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from train.core.config import AUTO, Config
from train.core.config.origins import origin_note, source_of
from train.core.errors import CannotRunHere, ConfigError

# Strategies that run exactly one process (DataParallel drives every GPU from it).
ONE_PROCESS = ("single", "dp")


def resolve_backend(requested: str, gpu: bool) -> str:
    """auto: nccl on GPUs (RCCL on ROCm, where torch names it nccl too), gloo on CPU."""
    if requested != AUTO:
        return requested
    return "nccl" if gpu else "gloo"


def backend_problem(backend: str, built: dict[str, bool], torch_version: str) -> str | None:
    """Why this torch cannot use ``backend`` (``built``: backend -> compiled in), or None."""
    if built.get(backend):
        return None
    return (f"distributed.backend={backend}: torch {torch_version} was built without "
            f"{backend}; use " + ("auto" if backend != "gloo" else "another backend")
            + (" (MPI needs a torch built from source against MPI)" if backend == "mpi" else ""))


def runs_one_process(strategy: str) -> bool:
    return strategy in ONE_PROCESS


def one_process_problem(strategy: str, launched: str) -> str:
    """The message for a one-process strategy launched as several (``launched`` says how)."""
    return f"distributed.strategy={strategy} runs one process, but {launched}; use ddp or fsdp"


@dataclass(frozen=True)
class GpuOnly:
    """A setting that needs a GPU, with what to say when there is none."""
    key: str
    contradiction: str   # the config itself says device=cpu: bad input (exit 2);
                         # {device}: where device=cpu came from, when not the key's source
    unavailable: str     # the machine has no usable GPU: cannot run here (exit 3)


def gpu_only_settings(cfg: Config) -> list[GpuOnly]:
    """The settings of ``cfg`` that cannot run without a GPU, in the order they are checked."""
    found = []
    if cfg.distributed.backend == "nccl":
        found.append(GpuOnly(
            "distributed.backend", "nccl needs GPUs but device is cpu{device}; use gloo (or auto)",
            "distributed.backend=nccl needs GPUs, and none is usable here; use backend "
            "auto/gloo, or run on a GPU machine"))
    if cfg.distributed.strategy == "dp":
        found.append(GpuOnly(
            "distributed.strategy", "dp (DataParallel) needs GPUs, but device is cpu{device}; use "
                                    "single or ddp",
            "distributed.strategy=dp needs GPUs and none is usable here; use single or ddp on "
            "CPU"))
    if cfg.memory.cpu_offload:
        found.append(GpuOnly(
            "memory.cpu_offload", "offloads from GPUs, but device is cpu{device}; set it to false",
            "memory.cpu_offload=true needs a GPU (torch cannot offload without an "
            "accelerator); none is usable here"))
    return found


def check_gpu_only(cfg: Config, gpu: bool, source: str) -> None:
    """A GPU-only setting without a GPU: bad input (exit 2) when the config itself says
    device=cpu, otherwise valid input this machine cannot run (exit 3)."""
    if gpu:
        return
    for setting in gpu_only_settings(cfg):
        if cfg.device == "cpu":  # each value with where it came from
            source = source_of(cfg, setting.key, source)
            raise ConfigError(source, setting.key, setting.contradiction.format(
                device=origin_note(cfg, "device", source)))
        raise CannotRunHere(setting.unavailable)
