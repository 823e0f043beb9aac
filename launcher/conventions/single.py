"""One node, nothing in the environment: torchrun ``--standalone`` (or the worker itself
when there is one process)."""

from __future__ import annotations

from launcher.conventions.common import Nodes
from launcher.environ import Environ

NAME = "single"


def detect(env: Environ) -> bool:
    return True


def nodes(env: Environ) -> Nodes:
    return Nodes(NAME, args=("--standalone", "--nnodes", "1"))
