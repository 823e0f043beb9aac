"""The launcher's signal handling: SIGTERM and SIGINT go on to the child it runs, and
the platform's requeue signal (SLURM's ``#SBATCH --signal``) stops it the same way.

The child runs in a session of its own (so a terminal's Ctrl-C reaches it once, through
us); torchrun forwards what it gets to the workers, which checkpoint and exit 143.
"""

from __future__ import annotations

import signal
import subprocess

FORWARDED = (signal.SIGTERM, signal.SIGINT)


class Forwarder:
    """Signal handlers that pass SIGTERM/SIGINT on to the current child. requeue_signal
    (SLURM's ``--signal``): stop the same way (the workers get SIGTERM), and remember
    that the job is to be requeued once they did."""

    def __init__(self, requeue_signal: int | None = None) -> None:
        self.proc: subprocess.Popen | None = None
        self.others: list[subprocess.Popen] = []  # more children at once (replica groups)
        self.received: list[int] = []
        self.requeue_signal = requeue_signal
        self._old: dict[int, object] = {}

    @property
    def requeue_asked(self) -> bool:
        return self.requeue_signal is not None and self.requeue_signal in self.received

    def install(self) -> None:
        for sig in (*FORWARDED, *([self.requeue_signal] if self.requeue_signal else [])):
            self._old[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _handle(self, signum: int, frame: object) -> None:
        self.received.append(signum)
        for proc in (self.proc, *self.others):
            if proc is not None and proc.poll() is None:
                proc.send_signal(self._to_child(signum))

    def _to_child(self, signum: int) -> int:
        return signal.SIGTERM if signum == self.requeue_signal else signum

    def attach(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        for sig in self.received:  # arrived while the child was starting
            proc.send_signal(self._to_child(sig))

    def attach_another(self, proc: subprocess.Popen) -> None:
        """One more child that gets the signals too (each replica group's torchrun)."""
        self.others.append(proc)
        for sig in self.received:
            proc.send_signal(self._to_child(sig))
