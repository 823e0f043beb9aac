"""A rank slower than its peers is named: which rank, on which host, in which phase.

In a data-parallel job every step waits for the slowest rank, so one throttling GPU, a
starved CPU or a slow data source slows the whole job, and nothing in the step time
says where. Each rank therefore measures its own part of each step, the parts that do
not wait for the other ranks:

- *data*: waiting for the next batch (its DataLoader, its storage);
- *compute*: the forward pass and loss, the backward pass up to the last gradient this
  rank made (DDP's gradient all-reduce ends the backward pass with a wait for the
  slowest rank: that wait is not counted), and the optimizer's update. On a GPU, whose
  kernels finish later than Python returns, the forward pass alone, timed with CUDA
  events (the host is never synchronised for it).

Under FSDP the forward pass gathers parameters too, so its split is rougher (a slow
rank still shows in *data*).

At each logging step the ranks' figures travel in the same collective that already
averages the loss and step time (an all-gather instead of an all-reduce: no extra
collective per step). Rank 0 compares each rank's median logging interval over the last
``logging.straggler_steps`` steps (and at least :data:`WINDOW_S` seconds) with the
median of the others': a rank at
``logging.straggler_ratio`` times that or more, whose excess costs the job at least
:data:`MIN_COST` of a step, is slow, and is named once, on the console and in
metrics.jsonl and TensorBoard; when it keeps pace again (within half those margins, so
that a rank near the bar is not named and cleared by turns), that is said too. A slow
interval now and then (a hiccup; a busy machine preempting the ranks by turns) moves
no median; all ranks slowing together keeps every ratio near 1.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

PHASES = ("data", "compute")
MIN_COST = 0.05  # of a step: a rank slower than this by less costs nothing worth a line
FLOOR_S = 1e-4   # the others' time taken as at least this for a ratio (no data wait: 0)
# A window shorter than this is a few scheduler time slices of a busy CPU: noise.
WINDOW_S = 10.0


class _Backward:
    """When a backward pass's gradients were all made, before DDP's final wait for the
    all-reduce. The autograd engine runs its queued callbacks in order once the graph is
    done; DDP queues the one that waits for the slowest rank (Reducer::finalize_backward)
    when its last gradient bucket is ready, after the one queued here when the loss's own
    gradient is made (the first of the pass). One hook a pass, where one per parameter
    cost a Python call per parameter."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = 0.0

    def started(self, grad_outputs: tuple) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self.gradients_done)

    def gradients_done(self) -> None:
        self.done = time.perf_counter()


class StepPhases:
    """This rank's seconds in each phase since the last :meth:`take`. Each phase is a
    call that does the phase's work and times it (several run every step: one call each,
    where a context manager costs two):

    - :meth:`next_batch`: waiting for the next batch;
    - :meth:`forward`: the forward pass and loss (on a GPU, timed by CUDA events);
    - :meth:`backward`: the backward pass, up to this rank's last gradient;
    - :meth:`update`: the optimizer's update (the CPU only: on a GPU it is asynchronous).
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.data_s = self.compute_s = 0.0  # the CPU's clock
        self._backward = _Backward()
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.watching = False

    def watch(self, model: torch.nn.Module) -> None:
        """On the CPU, the backward pass counts up to the end of this rank's gradients,
        before DDP's final wait for the all-reduce (see :meth:`backward`). A GPU's kernels
        finish later than the host returns: there the forward pass alone (its CUDA
        events) stands for compute."""
        self.watching = not self.cuda

    def next_batch(self, batches: Iterator) -> Any:
        start = time.perf_counter()
        batch = next(batches)
        self.data_s += time.perf_counter() - start
        return batch

    def forward(self, fn: Callable, *args: Any) -> Any:
        """``fn(*args)``: the forward pass and loss."""
        if self.cuda:  # kernels run later than Python returns: timed on the device
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args)
            end.record()
            self.events.append((start, end))
            return out
        start = time.perf_counter()
        out = fn(*args)
        self.compute_s += time.perf_counter() - start
        return out

    def update(self, fn: Callable, *args: Any) -> Any:
        """``fn(*args)``: the optimizer's update (counted on the CPU only)."""
        if self.cuda:
            return fn(*args)
        start = time.perf_counter()
        out = fn(*args)
        self.compute_s += time.perf_counter() - start
        return out

    def backward(self, loss: torch.Tensor, scaled: torch.Tensor | None = None) -> None:
        """Runs the backward pass of ``scaled`` (the gradient scaler's scaled ``loss``;
        ``loss`` itself by default) and counts it, on the CPU, up to the last gradient of
        this rank (see :meth:`watch`)."""
        scaled = loss if scaled is None else scaled
        node = loss.grad_fn
        if not self.watching or node is None:
            scaled.backward()
            return
        clock = self._backward
        clock.done, start = 0.0, time.perf_counter()
        node.register_prehook(clock.started)
        scaled.backward()
        if clock.done:
            self.compute_s += clock.done - start

    def take(self) -> tuple[float, float]:
        """(data, compute) seconds since the last take; starts counting again."""
        compute = self.compute_s
        for start, end in self.events:
            end.synchronize()
            compute += start.elapsed_time(end) / 1000
        taken = (self.data_s, compute)
        self.data_s = self.compute_s = 0.0
        self.events = []
        return taken


@dataclass(frozen=True)
class Finding:
    """A rank named slow (or no longer slow) at ``step``."""
    TAG: ClassVar[str] = "stragglers"  # TensorBoard's text tab
    step: int
    rank: int
    host: str
    phase: str              # data | compute
    ratio: float            # its phase time / the others' median
    seconds: float          # its time in that phase, per step
    others_s: float         # the others' median, per step
    steps: int              # how long it has been slow (0: it recovered)

    def line(self) -> str:
        where = f"rank {self.rank} ({self.host})"
        if not self.steps:
            return f"straggler: {where} keeps pace again at step {self.step}"
        return (f"straggler: {where} is slow in {self.phase}: {self.ratio:.1f}x the other "
                f"ranks' median ({self.seconds * 1000:.0f} vs {self.others_s * 1000:.0f} ms "
                f"a step) for the last {self.steps} steps; every step waits for it")

    def record(self) -> dict:
        return {"step": self.step, "event": "straggler" if self.steps else "straggler_over",
                "rank": self.rank, "host": self.host, "phase": self.phase,
                "ratio": round(self.ratio, 3), "seconds": self.seconds,
                "others_seconds": self.others_s, "steps": self.steps}


@dataclass
class Stragglers:
    """Rank 0's judge: :meth:`observe` every logging interval's per-rank figures."""
    ratio: float
    steps: int
    hosts: list[str]
    window: deque = field(default_factory=deque)   # (steps, per-rank figures, step time)
    named: dict[int, str] = field(default_factory=dict)        # rank -> its slow phase
    worst: float = 1.0      # the slowest rank's data + compute / the others' median

    def observe(self, step: int, interval: int, per_rank: list[tuple[float, float]],
                step_time: float) -> list[Finding]:
        """``per_rank``: each rank's (data, compute) seconds per step over the last
        ``interval`` steps, which ended at ``step`` and took ``step_time`` each. Judged
        over the last ``steps`` steps (or a little more), by each rank's median interval:
        a slow interval now and then moves nothing, a rank slow in most stands out."""
        self.worst = 1.0
        if self.ratio <= 0 or len(per_rank) < 2:
            return []
        self.window.append((interval, per_rank, step_time))
        while self._covers(list(self.window)[1:]):
            self.window.popleft()
        if not self._covers(self.window):
            return []
        covered = sum(n for n, _, _ in self.window)
        # each rank's median interval per phase: one spike in the window moves nothing
        means = [tuple(statistics.median(rows[r][i] for _, rows, _ in self.window)
                       for i in range(len(PHASES))) for r in range(len(per_rank))]
        mean_step = statistics.median(t for _, _, t in self.window)
        totals = [sum(m) for m in means]
        ordered = sorted(totals)
        self.worst = max(total / max(_median_without(ordered, total), FLOOR_S)
                         for total in totals)
        by_phase = [sorted(m[i] for m in means) for i in range(len(PHASES))]
        findings = []
        for rank in range(len(means)):
            slow = self._slowest_phase(means[rank], by_phase, mean_step, rank in self.named)
            if slow is None:
                findings += self._recovered(step, rank)
                continue
            phase, mine, others = slow
            if self.named.get(rank) != phase:
                self.named[rank] = phase
                findings.append(Finding(step, rank, self._host(rank), phase,
                                        mine / max(others, FLOOR_S), mine, others, covered))
        return findings

    def _covers(self, intervals) -> bool:
        return window_covers([(n, t) for n, _, t in intervals], self.steps)

    def _slowest_phase(self, mine_by_phase: tuple[float, ...], by_phase: list[list[float]],
                       step_time: float, named: bool) -> tuple[str, float, float] | None:
        """(phase, its seconds, the others' median) of a rank's slowest phase, if slow;
        ``by_phase``: every rank's figure of each phase, sorted. A rank already ``named``
        stays slow until it is within half the margins (ratio and cost): near the bar,
        a median that noise moves across it would name and clear it by turns."""
        ratio = 1 + (self.ratio - 1) / 2 if named else self.ratio
        cost = MIN_COST / 2 if named else MIN_COST
        worst = None
        for i, phase in enumerate(PHASES):
            mine = mine_by_phase[i]
            others = _median_without(by_phase[i], mine)
            costly = mine - others >= cost * max(step_time, 1e-9)
            if costly and mine >= ratio * others and (
                    worst is None or mine - others > worst[1] - worst[2]):
                worst = (phase, mine, others)
        return worst

    def _recovered(self, step: int, rank: int) -> list[Finding]:
        phase = self.named.pop(rank, None)
        if phase is None:
            return []
        return [Finding(step, rank, self._host(rank), phase, 1.0, 0.0, 0.0, 0)]

    def _host(self, rank: int) -> str:
        return self.hosts[rank] if rank < len(self.hosts) else "?"


def window_covers(intervals: list[tuple[int, float]], steps: int) -> bool:
    """Enough to judge: (steps, seconds a step) intervals of ``steps`` steps and
    WINDOW_S seconds in all."""
    return sum(n for n, _ in intervals) >= steps and sum(n * t for n, t in intervals) >= WINDOW_S


def _median_without(ordered: list[float], value: float) -> float:
    """The median of ``ordered`` (sorted) without one ``value`` it holds: each rank against
    the others, in O(log n) rather than a sort per rank (hundreds of ranks)."""
    gap = bisect.bisect_left(ordered, value)
    n = len(ordered) - 1

    def at(k: int) -> float:
        return ordered[k] if k < gap else ordered[k + 1]
    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2
