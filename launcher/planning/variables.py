"""The launcher's environment as a record: :class:`Environ` and the typed accessors.

Apart from :mod:`launcher.planning.environ`, which reads the environment into it and
checks every variable at once (including each launch convention's), so that the
conventions in :mod:`launcher.conventions` can take the record and its accessors
without importing the reader that asks them for their errors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from train.core.machine.host import DEFAULT_BUILD_MANIFEST

DEFAULT_DNS_WAIT_S = 300.0


def variable_error(name: str, problem: str) -> Exception:
    from train.core.errors import ConfigError  # torch-free, but keep --help import-light
    return ConfigError("environment", name, problem)


@dataclass(frozen=True)
class Visibility:
    """Device visibility variables as found (None = unset, "" = set but empty)."""
    cuda_visible_devices: str | None = None
    nvidia_visible_devices: str | None = None
    rocr_visible_devices: str | None = None
    hip_visible_devices: str | None = None
    hsa_override_gfx_version: str | None = None
    cuda_device_order: str | None = None

    def as_dict(self) -> dict[str, str | None]:
        return {"CUDA_VISIBLE_DEVICES": self.cuda_visible_devices,
                "NVIDIA_VISIBLE_DEVICES": self.nvidia_visible_devices,
                "ROCR_VISIBLE_DEVICES": self.rocr_visible_devices,
                "HIP_VISIBLE_DEVICES": self.hip_visible_devices,
                "HSA_OVERRIDE_GFX_VERSION": self.hsa_override_gfx_version,
                "CUDA_DEVICE_ORDER": self.cuda_device_order}


@dataclass(frozen=True)
class Environ:
    """What the environment says, already split into meaningful pieces."""
    raw: Mapping[str, str] = field(default_factory=dict, repr=False)
    visibility: Visibility = field(default_factory=Visibility)
    socket_ifname: str | None = None     # TRAIN_SOCKET_IFNAME: this node's interface
    debug: bool = False                  # TRAIN_DEBUG
    path: str = ""
    build_manifest: str = DEFAULT_BUILD_MANIFEST
    hw_root: str = "/"
    dns_wait_s: float = DEFAULT_DNS_WAIT_S

    def get(self, name: str) -> str | None:
        """A variable's value with surrounding blanks removed; None when unset or blank."""
        return text(self.raw, name)


def text(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name)
    return value.strip() if value is not None and value.strip() else None


def integer(env: Mapping[str, str], name: str) -> int | None:
    """A non-negative integer variable; None when unset; ConfigError when malformed."""
    value = text(env, name)
    if value is None:
        return None
    if not value.isdigit():
        raise variable_error(name, f"got {value!r}; expected a non-negative integer")
    return int(value)
