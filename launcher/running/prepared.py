"""What a command asks for (:class:`Request`) and what :func:`launcher.running.runner.prepare`
decided for it (:class:`Prepared`): the records handed from the deciding half of the
pipeline to the running half (:mod:`launcher.running.execute`), kept apart from both so
that neither imports the other back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from launcher.detection.hardware import Finding, Hardware, TorchBuild
from launcher.planning.plan import Plan
from launcher.planning.variables import Environ


@dataclass(frozen=True)
class Request:
    """What a command asks for, as parsed from its command line."""
    command: str                     # train | launch | doctor
    config: str | None = None        # the config file (train; doctor: optional)
    overrides: tuple[str, ...] = ()  # dotted.key=value
    script: tuple[str, ...] = ()     # launch: SCRIPT [args] or -m MODULE [args]
    dry_run: bool = False

    @property
    def collects(self) -> bool:
        """doctor reports every finding; the others stop at the first failure."""
        return self.command == "doctor"

    @property
    def writes(self) -> bool:
        """Allowed to create the output folder (nothing is written by doctor or a dry run)."""
        return self.command != "doctor" and not self.dry_run


@dataclass
class Prepared:
    """Everything :func:`prepare` decided, with what it found on the way."""
    request: Request
    env: Environ
    cfg: Any = None                  # train.core.config.Config, once it loaded
    hardware: Hardware = field(default_factory=Hardware)
    torch: TorchBuild = field(default_factory=TorchBuild)
    plan: Plan | None = None
    findings: list[Finding] = field(default_factory=list)
    data: dict | None = None         # data.kind tokens: its size and fetch (doctor, dry run)

    @property
    def exit_code(self) -> int:
        return max((f.exit_code for f in self.findings if f.level == "fail"), default=0)

    def finding(self, topic: str) -> Finding | None:
        return next((f for f in self.findings if f.topic == topic), None)
