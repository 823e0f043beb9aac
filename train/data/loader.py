"""The DataLoader a rank iterates (:func:`make_loader`), and its worker processes'
stop signals.

systemd, SLURM's scancel, `timeout`, a terminal's Ctrl-C and torchrun (which signals
each rank's process group) send SIGTERM/SIGINT to every process of the group, the
loader's workers included. Left as they are, a worker dies of SIGTERM (torch installs a
handler that re-raises it) and the main process raises "DataLoader worker (pid N) is
killed by signal" from its SIGCHLD handler in the middle of a step: no checkpoint. Or,
on SIGINT, each worker runs the inherited StopFlag handler and logs "received SIGINT"
once more. So workers ignore both: the main process alone decides to stop, checkpoints,
and then shuts the workers down (torch's done event). They still never outlive it: a
parent-death SIGKILL (on kill -9 of the main process torch's own watch on the parent
takes up to 5 s, and never ends a worker stuck in a dataset call). The kernel sends it
when the *thread* that started the workers ends: the trainer iterates its loader on the
main thread. A worker that ignores SIGTERM also ignores torch's terminate() of a worker
that did not stop within 5 s at shutdown; such a one then ends with the main process.
At the end of a run the trainer ends them itself (:func:`end_workers`): asked to stop the
way torch asks, then killed when they have not within seconds, so a worker that never
finishes exiting (a dataset's thread that never ends keeps its interpreter alive) cannot
hold the run's exit.

:func:`loader_worker_init` gives a DataLoader of the user's own the same setup.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from collections.abc import Callable

import torch
from torch.utils.data import DataLoader, Dataset

from train.core.machine.host import die_with_parent, process_alive

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
WORKERS_EXIT_S = 5.0  # how long workers asked to stop may take before they are killed


def worker_init(main_pid: int, user_init, worker_id: int) -> None:
    """Runs first in each loader worker, after torch's seeding, before ``user_init``."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)  # also discards one that arrived since the fork
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked by _signals_held
    die_with_parent(signal.SIGKILL)
    if not process_alive(main_pid):  # it died before the line above
        os.kill(os.getpid(), signal.SIGKILL)
    if user_init is not None:
        user_init(worker_id)


@contextlib.contextmanager
def _signals_held():
    """Hold SIGTERM/SIGINT while workers start: a forked worker inherits the mask, so one
    arriving before :func:`worker_init` runs is discarded there instead of killing it.
    The main process gets its own when the workers have started (it stays pending)."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


class Loader(DataLoader):
    """A DataLoader whose worker processes leave stop signals to the main process."""

    def __iter__(self):
        if self.num_workers == 0:
            return super().__iter__()
        with _signals_held():  # workers start here (or on the first iter, if persistent)
            return super().__iter__()


def loader_worker_init(user_init=None):
    """A DataLoader ``worker_init_fn`` that gives its workers the setup above (for a
    DataLoader of your own, e.g. in a script under ``entrypoint.py launch``). Create the
    DataLoader in the process that iterates it; ``user_init(worker_id)`` runs after."""
    return functools.partial(worker_init, os.getpid(), user_init)


def already_batched(batch):
    """collate_fn for datasets whose __getitems__ returns a whole batch."""
    return batch


def make_loader(dataset: Dataset, batch_sampler, *, num_workers: int, pin_memory: bool,
                persistent_workers: bool, prefetch_factor: int, seed: int,
                worker_init_fn=None) -> DataLoader:
    """``worker_init_fn(worker_id)``: runs in each worker after the signal setup of
    this module."""
    extra = {}
    if num_workers > 0:
        extra = {"persistent_workers": persistent_workers, "prefetch_factor": prefetch_factor,
                 "worker_init_fn": loader_worker_init(worker_init_fn)}
    return Loader(dataset, batch_sampler=batch_sampler, num_workers=num_workers,
                  pin_memory=pin_memory, collate_fn=already_batched,
                  generator=torch.Generator().manual_seed(seed), **extra)


def end_workers(batches, seconds_left: Callable[[], float]) -> str | None:
    """End the worker processes of a DataLoader iterator within ``seconds_left()`` (and
    WORKERS_EXIT_S at most): torch's own request (its done event, a None on each index
    queue), then SIGKILL for any still running. They ignore SIGTERM, so torch's
    terminate() could not end one; killing one loses nothing, a worker only reads data.
    Returns what was killed, in words, or None. A loader without workers, or one already
    shut down, is left as it is. (torch's _MultiProcessingDataLoaderIter has no public
    way to do this: the private names used here are those of torch 2.13.)"""
    workers = list(getattr(batches, "_workers", ()))
    if not workers or getattr(batches, "_shutdown", True):
        return None
    batches._workers_done_event.set()
    for worker_id in range(len(workers)):
        batches._mark_worker_as_unavailable(worker_id, shutdown=True)
    until = time.monotonic() + WORKERS_EXIT_S
    while any(w.is_alive() for w in workers) and \
            min(seconds_left(), until - time.monotonic()) > 0:
        time.sleep(0.05)
    stuck = [w for w in workers if w.is_alive()]
    if stuck and batches._worker_pids_set:
        # forgotten first: torch's SIGCHLD handler fails the iterator for a killed worker
        from torch.utils.data import _utils
        _utils.signal_handling._remove_worker_pids(id(batches))
        batches._worker_pids_set = False
    for w in stuck:
        with contextlib.suppress(ProcessLookupError):
            os.kill(w.pid, signal.SIGKILL)
    for w in stuck:
        w.join(timeout=1)
    batches._shutdown_workers()  # its queues; the workers are gone, so at once
    if not stuck:
        return None
    return (f"DataLoader worker process{'es' if len(stuck) > 1 else ''} "
            f"{', '.join(str(w.pid) for w in stuck)} (killed: still running "
            f"{WORKERS_EXIT_S:.0f} s after it was told to stop)")
