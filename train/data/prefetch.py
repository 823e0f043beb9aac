"""The micro-batches of each step of replica groups, loaded ahead in DataLoader workers.

In a plain run a rank reads a sequence of micro-batches fixed from the start
(:class:`train.data.order.RankBatchSampler`), which a DataLoader's worker processes load
ahead of the steps. With replica groups (``distributed.fault_tolerance: replicas``) what a
rank reads is known only once each step's quorum has formed
(:mod:`train.distributed.replica_slots`): usually its group's own slot at the next step,
but after a fault a group may compute another slot too, a step that failed is trained
again on the same samples, and a group that heals jumps to the live step. So the workers
here load a *prediction* (:class:`Plan`): the micro-batches of the slots this rank read
last, for the steps after. A micro-batch is named by its positions ``[lo, hi)`` in the
run's sample order, which fix its samples. One that a step asks for and the workers have
loaded (or are loading) is handed out, once. A step the plan did not predict (other
slots, a jump, the same step again) re-points it: the workers first finish what they
were asked before (kept where still of use), then load this step's micro-batches and
those of the steps after (``data.prefetch_factor`` per worker at a time). A micro-batch
handed out is not kept: a model may change its inputs in place.
Any micro-batch neither held nor on its way is read in the training process, as with
``data.num_workers: 0``. Whoever loads it, a micro-batch is
``dataset.__getitems__(order.take(lo, hi - lo))``: the same samples bit for bit (for a
dataset whose samples draw no random numbers).

The workers are those of :func:`train.data.loader.make_loader` (its seeding, its handling
of stop signals, :func:`~train.data.loader.end_workers` at the end), persistent for the
whole run: the batch sampler they are fed from (:class:`_Stream`) follows the plan the
training process sets, and a re-pointed plan restarts the iteration, not the processes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from torch.utils.data import Dataset

from train.data.loader import end_workers, make_loader
from train.data.order import GlobalOrder

Span = tuple[int, int]  # positions [lo, hi) of the run's sample order: one micro-batch
# the micro-batches a rank reads for these slots of the step starting at this position
Chunks = Callable[[int, list[int]], list[Span]]


class Plan:
    """The micro-batches a rank is predicted to read: those of ``slots`` in every step
    from the one at position ``first`` to the run's end (position ``end``), in the order
    it reads them. ``next()`` yields them one after the other."""

    def __init__(self, chunks: Chunks, step_size: int, first: int, end: int, slots: list[int]):
        self.chunks, self.step_size = chunks, step_size
        self.first, self.end, self.slots = first, end, list(slots)
        self.at = first  # the step whose micro-batches come next
        self._pending: deque[Span] = deque(chunks(first, self.slots) if first < end else ())

    def __next__(self) -> Span:
        while not self._pending:
            if not self.slots or self.at + self.step_size >= self.end:
                raise StopIteration
            self.at += self.step_size
            self._pending.extend(self.chunks(self.at, self.slots))
        return self._pending.popleft()

    def covers(self, first: int, end: int, slots: list[int]) -> bool:
        """Whether what this plan has still to yield is the prediction for a step at
        ``first`` reading ``slots``: the same slots, in step with it, not behind it (no
        slots: nothing to yield at any step)."""
        if slots != self.slots or end != self.end:
            return False
        return not slots or (self.at >= first >= self.first
                             and (first - self.first) % self.step_size == 0)


class _Stream:
    """The loader's batch sampler: the plan's micro-batches not already held or asked
    for, each as its sample indices; the positions asked for, oldest first, in
    ``issued`` (the loader returns them in that order). No plan: nothing to ask for."""

    def __init__(self, order: GlobalOrder, held: dict[Span, object], plan: Plan | None):
        self.order, self.held, self.plan = order, held, plan
        self.issued: deque[Span] = deque()

    def __iter__(self):
        return self

    def __next__(self) -> list[int]:
        if self.plan is None:
            raise StopIteration
        span = next(self.plan)
        while span in self.held or span in self.issued:
            span = next(self.plan)
        self.issued.append(span)
        return self.order.take(span[0], span[1] - span[0])


class StepReader:
    """``data.num_workers: 0``: every micro-batch loaded when the step asks for it, in
    the training process."""

    def __init__(self, dataset: Dataset, order: GlobalOrder, chunks: Chunks):
        self.dataset, self.order, self.chunks = dataset, order, chunks

    def step(self, first: int, slots: list[int], end: int) -> list[Span]:
        """The micro-batches to read for ``slots`` of the step at position ``first`` (of a
        run whose last step ends at position ``end``), in order."""
        return self.chunks(first, slots)

    def batch(self, span: Span):
        """The micro-batch at positions ``span``: the dataset's ``__getitems__``."""
        return self.dataset.__getitems__(self.order.take(span[0], span[1] - span[0]))

    def close(self, seconds_left: Callable[[], float]) -> str | None:
        """End what reads ahead; what had to be killed, in words, or None."""
        return None

    def summary(self) -> str | None:
        return None


class Prefetcher(StepReader):
    """Micro-batches loaded ahead by ``num_workers`` DataLoader workers along a
    :class:`Plan`; any other loaded here when asked for."""

    def __init__(self, dataset: Dataset, order: GlobalOrder, chunks: Chunks, plan: Plan, *,
                 num_workers: int, pin_memory: bool, prefetch_factor: int, seed: int):
        super().__init__(dataset, order, chunks)
        self.held: dict[Span, object] = {}  # loaded, not yet handed out
        self.first = plan.first  # the current step's position: anything before is dropped
        self.asked: int | None = None  # the position of the last step asked for
        self.stream = _Stream(order, self.held, plan)
        self.loader = make_loader(dataset, self.stream, num_workers=num_workers,
                                  pin_memory=pin_memory, persistent_workers=True,
                                  prefetch_factor=prefetch_factor, seed=seed)
        self.batches = iter(self.loader)  # the workers start, and load the plan's first
        self.num_workers, self.step_size = num_workers, plan.step_size
        # micro-batches handed out; of them loaded here; times the plan was re-pointed
        self.served = self.here = self.repointed = 0

    def step(self, first: int, slots: list[int], end: int) -> list[Span]:
        again = first == self.asked  # a retry: what it reads was handed out already
        self.first = self.asked = first
        for span in [s for s in self.held if s[0] < first]:
            del self.held[span]
        if again or not self.stream.plan.covers(first, end, slots):
            self._repoint(Plan(self.chunks, self.step_size, first, end, slots))
        return self.chunks(first, slots)

    def batch(self, span: Span):
        if span not in self.held and span in self.stream.issued:
            while span not in self.held:  # on its way: the ones asked for before it first
                self._take()
        self.served += 1
        if span in self.held:
            return self.held.pop(span)
        self.here += 1
        return super().batch(span)

    def _take(self) -> None:
        """The oldest micro-batch asked of the workers, held unless its step is past."""
        span = self.stream.issued.popleft()
        loaded = next(self.batches)
        if span[0] >= self.first:
            self.held[span] = loaded

    def _repoint(self, plan: Plan) -> None:
        """Follow ``plan`` from now on: what the workers were asked before comes back
        first (held where still of use), then their iteration starts again on the new
        plan (the same processes: persistent workers), ``prefetch_factor`` each ahead."""
        self.stream.plan = None  # nothing new asked meanwhile
        while self.stream.issued:
            self._take()
        self.stream.plan = plan
        self.batches = iter(self.loader)
        self.repointed += 1

    def close(self, seconds_left: Callable[[], float]) -> str | None:
        self.held.clear()
        return end_workers(self.batches, seconds_left)

    def summary(self) -> str | None:
        if not self.served:
            return None
        return (f"data: {self.served - self.here} of {self.served} micro-batches from "
                f"{self.num_workers} loader worker(s) (the rest read in the training "
                f"process); their read-ahead re-pointed {self.repointed} time(s): a step "
                "trained again, on other slots than the one before, or after a heal")


def open_reader(dataset: Dataset, order: GlobalOrder, chunks: Chunks, *, step_size: int,
                first: int, end: int, slots: list[int], num_workers: int, pin_memory: bool,
                prefetch_factor: int, seed: int) -> StepReader:
    """What reads a rank's micro-batches: in the training process (``num_workers`` 0), or
    loaded ahead by that many workers, predicting ``slots`` for the steps from position
    ``first`` on."""
    if num_workers <= 0:
        return StepReader(dataset, order, chunks)
    return Prefetcher(dataset, order, chunks, Plan(chunks, step_size, first, end, slots),
                      num_workers=num_workers, pin_memory=pin_memory,
                      prefetch_factor=prefetch_factor, seed=seed)
