"""One interface for the watchers that tell the supervisor a node or the store is lost.

A run gets the watchers its plan names (:attr:`launcher.planning.plan.Plan.liveness`):

- ``rounds``, an elastic job with a rendezvous store: this node's pulse socket
  (:mod:`launcher.liveness.pulse`) and the round watcher
  (:class:`~launcher.liveness.rounds.RoundWatcher`), which stops this node's workers when
  a member vanished or when this node was left out of a newer round, names every node's
  ranks waiting for each other (a partition: :mod:`launcher.liveness.partition`), and
  tells the supervisor when the store stopped answering while no worker runs;
- ``heartbeat``, a static job: the launchers beat at the rank-0 node
  (:class:`~launcher.liveness.heartbeat.PeerHeartbeat`), which stops this node's workers
  when a node is lost and names it once the workers ended.

The supervisor (:mod:`launcher.running.supervise`) knows none of them: it binds them
before the child starts (:meth:`Liveness.bind`), starts them with the child
(:meth:`Liveness.start`), asks :meth:`Liveness.lost` while the child runs and once it
ended, and stops them (:meth:`Liveness.stop`). A new way to watch the nodes is one class
here with ``bind``, ``start``, ``lost`` and ``stop``, and its name in the plan.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from launcher.liveness.heartbeat import PeerHeartbeat
from launcher.liveness.heartbeat_wire import listen, resolve
from launcher.liveness.partition import PartitionWatch
from launcher.liveness.pulse import Pulse
from launcher.liveness.rounds import RoundWatcher

if TYPE_CHECKING:
    from launcher.planning.plan import Plan

# How long a stopped watcher may take to say goodbye to the other nodes (a node that
# vanishes without one is called lost by the others, whose workers may still be
# writing their stop checkpoint); the launcher's exit waits no longer for it.
GOODBYE_S = 2.0


@dataclass(frozen=True)
class Child:
    """The child a run's watchers look after, and what they may do to it."""
    pid: int
    local_id: int                                # its rendezvous identity (launcher.torchrun)
    stop_workers: Callable[[str, str], None]     # (what happened, what follows): no checkpoint
    workers_alive: Callable[[], bool]
    status_dir: str | None = None                # where its workers report (the protocol)


@dataclass(frozen=True)
class Loss:
    """What a watcher found lost: ``store`` (the rendezvous store stopped answering while
    no worker runs: wait for it and start torchrun again) or ``node`` (a static job's node
    vanished: the run ends, naming it); ``what`` is the line that says so."""
    kind: str
    what: str


class Watcher(Protocol):
    def bind(self) -> str | None:
        """Before the child starts: what it holds early; the reason the launch cannot run
        here (exit 3), or None."""

    def start(self, child: Child) -> None: ...

    def lost(self, rc: int | None, signalled: bool) -> Loss | None:
        """Asked while the child runs (``rc`` None) and once it ended (its exit status;
        ``signalled``: stopped by a signal here)."""

    def stop(self) -> None: ...


class Rounds:
    """An elastic job's watcher: this node's pulse and its view of the rendezvous rounds."""

    def __init__(self, plan: Plan, log: Callable[[str], None]) -> None:
        self.plan, self.log = plan, log
        self.pulse: Pulse | None = None
        self.watcher: RoundWatcher | None = None
        self.child: Child | None = None

    def bind(self) -> str | None:
        return None

    def start(self, child: Child) -> None:
        plan, self.child = self.plan, child
        self.pulse = self._pulse()
        self.watcher = RoundWatcher(
            plan.store, plan.job, plan.nnodes, plan.join_timeout_s, self.log,
            lost_after_s=plan.lost_after_s,
            on_lost=lambda nodes, why: child.stop_workers(
                f"node(s) {', '.join(nodes)} left the job ({why})",
                "so that the job meets again without it"),
            me=f":{child.pid}#{child.local_id}",
            on_left_out=lambda number: self._rejoin(child, number),
            silence_s=plan.silence_s, pulse=self.pulse, partition=self._partition(child))
        self.watcher.start()

    def lost(self, rc: int | None, signalled: bool) -> Loss | None:
        """The store, while the child runs: torchrun meets again at a store that vanished,
        and its calls would each wait a minute and more."""
        watcher = self.watcher
        if rc is not None or watcher is None or \
                watcher.unreachable_for() <= self.plan.lost_after_s or \
                self.child.workers_alive():
            return None
        return Loss("store", f"the rendezvous store {self.plan.store} has not answered for "
                             f"{watcher.unreachable_for():.0f} s and torchrun needs it to "
                             "meet again")

    def stop(self) -> None:
        _stop_thread(self.watcher)
        if self.pulse is not None:
            self.pulse.close()

    def _partition(self, child: Child) -> PartitionWatch | None:
        """Several nodes training: name their ranks waiting for each other (a partition)."""
        plan = self.plan
        if plan.nnodes[1] < 2 or not child.status_dir or plan.program != "train":
            return None
        return PartitionWatch(plan.job, f"{child.pid}#{child.local_id}", child.status_dir,
                              plan.nproc_per_node, self.log)

    def _pulse(self) -> Pulse | None:
        """This node's pulse, at the address its peers know it by."""
        argv = list(self.plan.argv)
        name = argv[argv.index("--local-addr") + 1] if "--local-addr" in argv \
            else socket.getfqdn()
        try:
            pulse = Pulse(resolve(name, 0) or name)
        except OSError as exc:
            self.log(f"no pulse socket ({exc}): a peer silent for a few seconds counts as gone")
            return None
        pulse.start()
        return pulse

    @staticmethod
    def _rejoin(child: Child, number: int) -> None:
        """This node was cut off and the others met without it: its workers are in a world
        that no longer exists."""
        if child.workers_alive():
            child.stop_workers(f"rendezvous round {number} went on without this node (it "
                               "was cut off from the others)", "so that it joins the job again")


class Heartbeat:
    """A static job's watcher: the launchers beat at the rank-0 node."""

    def __init__(self, plan: Plan, log: Callable[[str], None]) -> None:
        self.plan, self.log = plan, log
        self.listener: socket.socket | None = None
        self.beat: PeerHeartbeat | None = None

    def bind(self) -> str | None:
        """The rank-0 node binds its heartbeat port before any worker starts: a port another
        program holds ends the launch with exit 3 naming it (the other nodes would otherwise
        talk to that program and stop the job later with a false loss)."""
        master, port, rank = self.plan.heartbeat
        if rank != 0:
            return None
        try:
            self.listener, note = listen(master, port)
        except OSError as exc:
            return (f"error: {exc.strerror} on {socket.gethostname()} (held by another "
                    "program: free it, or give the job another MASTER_PORT)")
        if note:
            self.log(note)
        return None

    def start(self, child: Child) -> None:
        plan = self.plan
        master, port, rank = plan.heartbeat
        self.beat = PeerHeartbeat(
            master, port, rank, plan.nnodes[1], socket.gethostname(), plan.lost_after_s,
            on_lost=lambda what: child.stop_workers(
                what, "(a static job cannot replace a node: it ends)"),
            silence_s=plan.silence_s, join_timeout_s=plan.join_timeout_s, log=self.log,
            job=plan.job, listener=self.listener)
        self.beat.start()

    def lost(self, rc: int | None, signalled: bool) -> Loss | None:
        """Once this node's run failed, the lost node (its ranks may have failed first, on
        their lost connection to node 0's workers: node 0's word is read then)."""
        beat = self.beat
        if rc is None or rc == 0 or beat is None:
            return None
        what = beat.lost if signalled else beat.word_of_node_0(within_s=3 * beat.beat_s)
        return Loss("node", what) if what else None

    def stop(self) -> None:
        _stop_thread(self.beat)
        if self.beat is None and self.listener is not None:
            self.listener.close()  # bound, but the child never started


KINDS: dict[str, Callable[[Plan, Callable[[str], None]], Watcher]] = {
    "rounds": Rounds, "heartbeat": Heartbeat}


class Liveness:
    """The watchers a plan chose, driven as one."""

    def __init__(self, watchers: list[Watcher]) -> None:
        self.watchers = watchers

    def bind(self) -> str | None:
        return next((why for w in self.watchers if (why := w.bind()) is not None), None)

    def start(self, child: Child) -> None:
        for w in self.watchers:
            w.start(child)

    def lost(self, rc: int | None = None, signalled: bool = False) -> Loss | None:
        return next((loss for w in self.watchers
                     if (loss := w.lost(rc, signalled)) is not None), None)

    def stop(self) -> None:
        for w in self.watchers:
            w.stop()


def for_plan(plan: Plan, log: Callable[[str], None]) -> Liveness:
    """The watchers the plan names, not started."""
    return Liveness([KINDS[name](plan, log) for name in plan.liveness])


def _stop_thread(thread) -> None:
    if thread is not None:
        thread.stop.set()
        if thread.is_alive():  # its goodbye, before this process ends (exit_now)
            thread.join(GOODBYE_S)
