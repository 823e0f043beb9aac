"""Environment variables a worker needs before torch starts communicating, decided in
one place.

The launcher's plan sets them (so ``--dry-run`` shows them), and the worker applies the
same defaults to itself before it joins the process group, so ``torchrun -m train``
without the launcher gets them too. A value already in the environment (the user's, or
the launcher's) always wins. Torch-free.

- ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``: a failed or timed-out collective ends the
  process instead of hanging it.
- The NCCL flight recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE``, ``TORCH_NCCL_DUMP_ON_TIMEOUT``,
  ``TORCH_FR_DUMP_TEMP_FILE``; ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` for older torch): a
  timeout dumps, per rank, which collective each rank was in, into the run directory.
- ``NCCL_DEBUG``: WARN (errors are printed), INFO with ``distributed.debug``.
- ``CUBLAS_WORKSPACE_CONFIG=:4096:8``: required by deterministic cuBLAS; it must be set
  before the first cuBLAS handle exists.
- ``CUDA_DEVICE_ORDER=PCI_BUS_ID``: CUDA numbers GPUs as NVML does (the launcher counts
  GPUs through NVML).
- ``NCCL_SOCKET_IFNAME`` / ``GLOO_SOCKET_IFNAME``: the interface for communication,
  when one is named (nodes with several interfaces can otherwise stall, pytorch#64926);
  ``lo`` for a run on one node (``loopback``), so that gloo's listening sockets and
  NCCL's bootstrap are not reachable from other machines.
- ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` with ``distributed.debug``.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

FLIGHT_RECORDER_FILE = "nccl-flight-recorder-rank-"
LOOPBACK_IFNAME = "lo"  # Linux's loopback interface (containers included)


def worker_defaults(*, gpu: bool, backend: str, vendor: str | None, deterministic: bool,
                    run_dir: Path, debug: bool, socket_ifname: str | None,
                    loopback: bool = False) -> dict[str, str]:
    """The variables, in the order the launcher shows them.

    vendor: "nvidia" | "amd" | None (GPU stack); backend: the process-group backend;
    loopback: every process of the run is on this machine.
    """
    out: dict[str, str] = {}
    if vendor == "nvidia":
        out["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    if deterministic and gpu:
        out["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    if backend == "nccl":
        flight = str(Path(run_dir) / FLIGHT_RECORDER_FILE)
        out.update({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
                    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
                    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                    "TORCH_FR_DUMP_TEMP_FILE": flight,
                    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": flight,
                    "NCCL_DEBUG": "INFO" if debug else "WARN"})
    socket_ifname = socket_ifname or (LOOPBACK_IFNAME if loopback else None)
    if socket_ifname:
        out["NCCL_SOCKET_IFNAME"] = socket_ifname
        out["GLOO_SOCKET_IFNAME"] = socket_ifname
    if debug:
        out["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    return out


def apply_defaults(values: dict[str, str],
                   environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set each variable the environment does not already have; returns those set."""
    environ = os.environ if environ is None else environ
    added = {k: v for k, v in values.items() if not environ.get(k, "").strip()}
    environ.update(added)
    return added
