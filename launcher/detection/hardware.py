"""Plain records of what detection found: GPUs, the vendor stack, the torch build.

Kept apart from the detectors so that the planner and doctor depend on data only,
and tests can build any machine they like from these records.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Gpu:
    """One device this process can use, in the order torch will number it."""
    index: int                       # torch's cuda:<index> after visibility filtering
    name: str
    uuid: str | None = None          # GPU-... / MIG-... (NVIDIA), amd-smi's UUID (AMD)
    memory_bytes: int | None = None
    arch: str | None = None          # "sm_90" (NVIDIA compute capability), "gfx90a" (AMD)
    physical_index: int | None = None  # NVML index / KFD node id on the host
    mig: bool = False                # a MIG instance (or a GPU with MIG mode on)
    bus_id: str | None = None
    brand: str | None = None         # NVIDIA product brand as NVIDIA_REQUIRE_CUDA names it


@dataclass(frozen=True)
class Hardware:
    """Detection result. ``gpus`` are the usable, visible devices only."""
    vendor: str | None = None        # "nvidia" | "amd" | None
    source: str = "none"             # nvml | amd-smi | rocm-smi | sysfs | none
    gpus: tuple[Gpu, ...] = ()
    listed: int = 0                  # devices the tool lists before visibility/containers
    driver_version: str | None = None
    cuda_driver_version: str | None = None   # newest CUDA the driver supports, "13.0"
    cuda_compat: str | None = None   # the image's CUDA forward-compatibility libcuda, if any
    cuda_requirement: str | None = None  # the image's NVIDIA_REQUIRE_CUDA (from its CUDA base)
    notes: tuple[str, ...] = ()      # informational (why NVML is absent, ...)
    warnings: tuple[str, ...] = ()   # likely problems (conflicting visibility variables, ...)
    cpus: int = 1
    memory_available: int | None = None  # bytes of host memory still free (cgroup-aware)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TorchBuild:
    """What the installed torch was built for; read without initialising CUDA/HIP."""
    version: str = "unknown"
    cuda: str | None = None          # torch.version.cuda, e.g. "13.0"
    hip: str | None = None           # torch.version.hip on ROCm builds
    arch_list: tuple[str, ...] = ()  # sm_75 ... / gfx90a ... compiled into the build
    nccl: bool = False
    gloo: bool = True
    mpi: bool = False
    importable: bool = True
    error: str | None = None

    @property
    def kind(self) -> str:
        if not self.importable:
            return "missing"
        if self.hip:
            return "rocm"
        if self.cuda:
            return "cuda"
        return "cpu"

    def to_dict(self) -> dict:
        return {**asdict(self), "kind": self.kind}


@dataclass(frozen=True)
class Finding:
    """One doctor/plan finding: level is ok | warn | fail."""
    level: str
    topic: str
    message: str
    fix: str | None = None
    exit_code: int = 0               # for fail: 2 or 3

    def to_dict(self) -> dict:
        return asdict(self)
