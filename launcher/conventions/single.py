"""One node, nothing in the environment: torchrun ``--standalone`` (or the worker itself
when there is one process).

torchrun restarts all local workers when one fails, through a new rendezvous round;
on torch 2.13 that round completes only with the rendezvous store not shared
(see :mod:`.common`): with two processes and the default, the first restart fails
("connectFullMesh ... Connection refused") and the next one hangs.
"""

from __future__ import annotations

from launcher.conventions.common import RE_RENDEZVOUS_ENV, Nodes, Timings
from launcher.environ import Environ

NAME = "single"


def detect(env: Environ) -> bool:
    return True


def nodes(env: Environ, timings: Timings) -> Nodes:
    return Nodes(NAME, args=("--standalone", "--nnodes", "1"), env=dict(RE_RENDEZVOUS_ENV),
                 alone=True)
