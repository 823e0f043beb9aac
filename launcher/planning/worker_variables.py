"""The environment variables a launch plan sets for its workers.

Defaults give way to the user: a variable already set in the launcher's environment
keeps its value, and the plan says so in a warning when it would have chosen another.
Forced values (the interpreter's settings, and the identity of a single directly-run
worker) are always set.
"""

from __future__ import annotations

from launcher.planning.variables import Environ


class WorkerVariables:
    """Collects the variables of one plan, in the order ``--dry-run`` shows them."""

    def __init__(self, environ: Environ) -> None:
        self.environ = environ
        self.values: dict[str, str] = {}
        self.kept: list[str] = []   # user values that won over a default

    def default(self, name: str, value: str) -> None:
        mine = self.environ.get(name)
        if mine is None:
            self.values[name] = value
        elif mine != value:
            self.kept.append(f"{name}={mine} (set by you; the launcher would set {value})")

    def defaults(self, values: dict[str, str]) -> None:
        for name, value in values.items():
            self.default(name, value)

    def force(self, name: str, value: str) -> None:
        self.values[name] = value


def direct_worker_identity(master_port: int, max_restarts: int) -> dict[str, str]:
    """What torchrun would give a single worker, so stray variables cannot leak in."""
    ones = dict.fromkeys(("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE",
                          "ROLE_WORLD_SIZE"), "1")
    return {"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "ROLE_RANK": "0", **ones,
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port),
            "TORCHELASTIC_MAX_RESTARTS": str(max_restarts)}
