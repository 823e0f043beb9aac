"""How many CPU threads a rank computes with and how its idle OpenMP threads wait,
decided in one place: the launcher's plan sets these variables for its workers (so
``--dry-run`` shows them), and a worker started without it (``torchrun -m train``)
applies the same defaults to itself before torch loads. A value the user set wins.
Torch-free.

- ``OMP_NUM_THREADS``: the CPUs this process may use (its affinity mask, capped by its
  cgroup's CPU quota: :func:`train.core.machine.host.available_cpus`) shared by the node's ranks.
- ``OMP_WAIT_POLICY=PASSIVE``: a thread of torch's OpenMP pool that waits for work or
  for the others at the end of a parallel region sleeps at once instead of spinning.
  torch's CPU wheels use GNU OpenMP (libgomp), which otherwise spins about 300,000 times
  (``GOMP_SPINCOUNT``'s default, a few milliseconds) before it sleeps. On a machine with
  free cores that spin saves a wake-up per region; on one that is busy (other jobs, a
  container's quota, data-loader workers) a spinning thread burns the CPU time the thread
  it waits for needs, and every region then waits for the scheduler: the quick start ran
  40-55x slower than idle on a busy 2-core machine, 3x slower than with passive waiting.
  ``bench/oversubscribe.py`` measures both sides; docs/training.md has the figures. A
  user's own ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` chooses instead.

libgomp reads these once, when it is loaded (``import torch``): setting them later in
the same process changes nothing, which is why a bare worker applies them before its
first import of torch and the launcher puts them in its workers' environment.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping

WAIT_POLICY = "PASSIVE"
# GNU OpenMP's own knob: a spin count the user set replaces any policy's.
SPIN_COUNT = "GOMP_SPINCOUNT"


def threads_per_rank(cpus: int, nproc: int) -> int:
    """Each of the node's ``nproc`` ranks gets an equal share of its ``cpus``, at least 1."""
    return max(1, cpus // max(1, nproc))


def thread_defaults(cpus: int, nproc: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables, in the order the launcher shows them (each gives way to the user's
    own value). No wait policy when the user set ``GOMP_SPINCOUNT``: that chooses the wait."""
    out = {"OMP_NUM_THREADS": str(threads_per_rank(cpus, nproc))}
    if not (environ.get(SPIN_COUNT) or "").strip():
        out["OMP_WAIT_POLICY"] = WAIT_POLICY
    return out


def apply_before_torch(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """A worker started without the launcher: the wait policy, unless the user chose the
    wait or torch is loaded already (then it would change nothing). Returns what it set.
    The thread count needs no variable: the worker sets it through torch."""
    environ = os.environ if environ is None else environ
    if "torch" in sys.modules or any((environ.get(name) or "").strip()
                                     for name in ("OMP_WAIT_POLICY", SPIN_COUNT)):
        return {}
    environ["OMP_WAIT_POLICY"] = WAIT_POLICY
    return {"OMP_WAIT_POLICY": WAIT_POLICY}
