"""The launcher's environment, read once into a frozen
:class:`~launcher.planning.variables.Environ`.

Here: the settings every launch reads (device visibility, where tools and the build
manifest are, node-level overrides such as ``TRAIN_SOCKET_IFNAME``). The variables of
each launch convention (torchrun's ``PET_*``, Kubeflow's, the Indexed Job's) are read
by that convention's own unit in :mod:`launcher.conventions`, from the same frozen
mapping, never from ``os.environ``. Malformed values raise
:class:`~train.core.errors.ConfigError` naming the variable (exit 2).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from launcher.planning.variables import (
    DEFAULT_DNS_WAIT_S,
    Environ,
    Visibility,
    integer,
    text,
    variable_error,
)
from train.core.machine.host import DEFAULT_BUILD_MANIFEST


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    value = text(env, name)
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        raise variable_error(name, f"got {value!r}; expected a number of seconds") from None
    if not number >= 0:  # also rejects nan
        raise variable_error(name, f"got {value!r}; expected a number of seconds >= 0")
    return number


def _flag(env: Mapping[str, str], name: str) -> bool:
    value = (text(env, name) or "0").lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise variable_error(name, f"got {value!r}; expected 1 or 0")


# One entry of a visibility list: an index (-1 hides all), or a device UUID (prefix).
_VISIBLE_ENTRY = re.compile(r"-?\d+|GPU-[0-9A-Fa-f-]+|MIG-[0-9A-Za-z/-]+")


def _visibility_list(env: Mapping[str, str], name: str) -> str | None:
    """The variable as set, after checking that each entry can name a device (the
    runtimes silently treat anything else as the end of the list: no GPU, no error)."""
    value = env.get(name)
    if value is None or not value.strip():
        return value
    for entry in (e.strip() for e in value.split(",")):
        if not _VISIBLE_ENTRY.fullmatch(entry):
            raise variable_error(
                name, f"entry {entry[:40]!r} of {value[:80]!r} is not a device index or "
                      "GPU-/MIG- UUID; use e.g. 0,1 or GPU-<uuid> (doctor lists the GPUs)")
    return value


def _positive(env: Mapping[str, str], name: str) -> None:
    value = text(env, name)
    if value is not None and (not value.isdigit() or int(value) < 1):
        raise variable_error(name, f"got {value!r}; expected a positive integer")


def _port(env: Mapping[str, str], name: str) -> None:
    value = text(env, name)
    if value is not None and (not value.isdigit() or not 0 < int(value) < 65536):
        raise variable_error(name, f"got {value!r}; expected a port 1..65535")


def read(env: Mapping[str, str] | None = None) -> Environ:
    """Read the environment once. ``env`` defaults to ``os.environ``. Every malformed
    variable is reported at once, one line each (:func:`train.core.errors.raise_all`)."""
    from train.core.errors import ConfigError, raise_all
    env = dict(os.environ if env is None else env)
    errors: list[ConfigError] = []

    def checked(check, name: str, *args, fallback=None):
        try:
            return check(env, name, *args)
        except ConfigError as exc:
            errors.append(exc)
            return fallback

    checked(_positive, "OMP_NUM_THREADS")
    checked(_port, "MASTER_PORT")
    checked(integer, "JOB_COMPLETION_INDEX")
    visibility = Visibility(
        cuda_visible_devices=checked(_visibility_list, "CUDA_VISIBLE_DEVICES"),
        nvidia_visible_devices=env.get("NVIDIA_VISIBLE_DEVICES"),
        rocr_visible_devices=checked(_visibility_list, "ROCR_VISIBLE_DEVICES"),
        hip_visible_devices=checked(_visibility_list, "HIP_VISIBLE_DEVICES"),
        hsa_override_gfx_version=text(env, "HSA_OVERRIDE_GFX_VERSION"),
        cuda_device_order=text(env, "CUDA_DEVICE_ORDER"))
    debug = checked(_flag, "TRAIN_DEBUG", fallback=False)
    dns_wait_s = checked(_seconds, "TRAIN_DNS_WAIT_S", DEFAULT_DNS_WAIT_S,
                         fallback=DEFAULT_DNS_WAIT_S)
    if errors:  # the launch convention's variables too: every malformed one at once
        from launcher.conventions import variable_errors
        named = {e.key for e in errors}
        errors += variable_errors(read({k: v for k, v in env.items() if k not in named}))
    raise_all(errors)
    return Environ(
        raw=env, visibility=visibility,
        socket_ifname=text(env, "TRAIN_SOCKET_IFNAME"),
        debug=debug,
        path=env.get("PATH", os.defpath),
        build_manifest=text(env, "TRAIN_BUILD_MANIFEST") or DEFAULT_BUILD_MANIFEST,
        hw_root=text(env, "TRAIN_HW_ROOT") or "/",
        dns_wait_s=dns_wait_s)
