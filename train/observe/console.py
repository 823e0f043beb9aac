"""Rank 0's console: what a person watching the run sees.

On a terminal (``logging.progress=bar``, or ``auto`` with a tty) a bar is redrawn as
every step ends, at most ten times a second, from the wall clock alone (no device
synchronisation: the loss shown is the last logged one). Elsewhere (``plain``: a log
file, CI) a line per logging interval. The ETA comes from a smoothed step time (an
exponential average per step, so it does not jump with each logging window), and the
first step, which pays for start-up, never counts. Log records (warnings) first end an
open bar line, so they never land on it.
"""

from __future__ import annotations

import logging
import math
import sys
import time

REDRAW_S = 0.1
SMOOTHING = 0.05  # weight of one step's time in the average


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}" if h else f"{rem // 60}:{rem % 60:02d}"


class StepRate:
    """Seconds per step, averaged exponentially per step (however many steps apart the
    updates come). The first update only sets the baseline."""

    def __init__(self) -> None:
        self.seconds_per_step: float | None = None
        self._last: tuple[int, float] | None = None

    def update(self, step: int, now: float) -> None:
        if self._last is not None and step > self._last[0]:
            steps, dt = step - self._last[0], now - self._last[1]
            sample = dt / steps
            if self.seconds_per_step is None:
                self.seconds_per_step = sample
            else:
                keep = (1 - SMOOTHING) ** steps
                self.seconds_per_step = keep * self.seconds_per_step + (1 - keep) * sample
        self._last = (step, now)

    def eta(self, steps_left: int) -> float:
        return math.inf if self.seconds_per_step is None else steps_left * self.seconds_per_step


class _EndBarLine(logging.Filter):
    """Runs before a handler writes a record: ends the bar's line first."""

    def __init__(self, console: Console):
        super().__init__()
        self.console = console

    def filter(self, record: logging.LogRecord) -> bool:
        self.console.end_line()
        return True


class Console:
    def __init__(self, max_steps: int, unit: str, bar: bool, out=None):
        self.max_steps, self.unit, self.bar = max_steps, unit, bar
        self.out = out or sys.stdout
        self.rate = StepRate()
        self.values: dict[str, float] = {}
        self.step_time = math.nan
        self._open = False       # the bar's line awaits its newline
        self._drawn = -math.inf  # when the bar was last drawn
        self._filter = _EndBarLine(self) if bar else None
        if self._filter:
            for handler in logging.getLogger().handlers:
                handler.addFilter(self._filter)

    def step(self, step: int) -> None:
        """Every step, with the bar only: the bar moves. (Plain lines are written by
        :meth:`row`, which feeds the ETA then.)"""
        now = time.perf_counter()
        self.rate.update(step, now)
        if now - self._drawn >= REDRAW_S or step == self.max_steps:
            self._draw(step, now)

    def row(self, step: int, values: dict[str, float], step_time: float) -> None:
        """A logging interval's values (after ``step`` for the same step)."""
        self.values, self.step_time = values, step_time
        if self.bar:
            self._draw(step, time.perf_counter())
        else:
            self.rate.update(step, time.perf_counter())  # the same ETA from fewer samples
            self._write(self._line(step) + "\n")

    def eval(self, step: int, values: dict[str, float]) -> None:
        self.end_line()
        self._write(f"step {step} | " + " | ".join(f"{k} {v:.4g}" for k, v in values.items())
                    + "\n")

    def end_line(self) -> None:
        if self._open:
            self._open = False
            self._write("\n")

    def close(self) -> None:
        self.end_line()
        if self._filter:
            for handler in logging.getLogger().handlers:
                handler.removeFilter(self._filter)

    def _line(self, step: int) -> str:
        parts = [f"step {step}/{self.max_steps}"]
        parts += [f"{k} {v:.4g}" for k, v in self.values.items() if k != "throughput"]
        if "throughput" in self.values:
            parts.append(f"{self.values['throughput']:.0f} {self.unit}/s")
        if math.isfinite(self.step_time):
            parts.append(f"{self.step_time * 1000:.0f} ms/step")
        parts.append(f"eta {format_duration(self.rate.eta(self.max_steps - step))}")
        return " | ".join(parts)

    def _draw(self, step: int, now: float) -> None:
        self._drawn = now
        done = int(30 * step / self.max_steps)
        self._write(f"\r[{'#' * done}{'.' * (30 - done)}] {self._line(step)}\x1b[K")
        self._open = True  # ended by the next evaluation, log record or close()

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()
