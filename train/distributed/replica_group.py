"""This process's seat among replica groups (``distributed.fault_tolerance: replicas``),
on torchft's Manager.

Each step begins with a quorum of the groups alive (the job's Lighthouse decides it); a
group behind the others (one that restarted) first heals: it receives the state of a
live peer (model, optimizer, schedule, progress) over HTTP, not from a checkpoint. The
step's gradients are summed across the quorum's groups with one fault-tolerant
all-reduce; a step in which anything failed is not committed, by any group that saw the
failure, and is trained again with the next quorum on the same samples
(:mod:`train.loop.replica_loop`).

The quorum is taken synchronously (``use_async_quorum=False``): a group that heals has
the state before it computes, and takes part in that same step. Every group in the
quorum participates; which slots of the batch each computes is
:mod:`train.distributed.replica_slots`'. The timeouts keep the order of
:mod:`train.core.run.replica_contract`.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import ReduceOp, TCPStore

from train.core.config import Config
from train.core.errors import CannotRunHere
from train.core.run.identity import WorkerIdentity
from train.core.run.replica_contract import Timeouts
from train.distributed import replica_watch
from train.distributed.group_pulse import GroupPulse

log = logging.getLogger("train")


@dataclass(frozen=True)
class Quorum:
    """One step's membership, as this group sees it."""
    participant: int    # this group's index among the participants
    participants: int   # groups in the quorum
    step: int           # the step the quorum trains (after a heal: the peers')
    healed: bool        # this group received its state from a peer for it
    members: tuple[int, ...] = ()  # the replica group ids in it, in participant order
    quorum_id: int = -1  # the Lighthouse's: changes whenever the membership changed


# torchft's loggers: a line per quorum, commit and heal at INFO, and a traceback at ERROR
# for every failed all-reduce; what matters (a step not committed and why, a heal) the
# loop says in one line of its own.
TORCHFT_LOGGERS = ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors")


def _torchft():
    # its Rust side (Lighthouse client, Manager server) logs through RUST_LOG
    os.environ.setdefault("RUST_LOG", "warn")
    for name in TORCHFT_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    # a heal's tensors arrive in a read-only buffer that torch copies from
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    try:
        import torchft
    except ImportError as exc:  # the launcher checks first; a bare worker may lack it
        raise CannotRunHere(f"distributed.fault_tolerance=replicas needs torchft ({exc}); "
                            "install it with pip install 'trainpod[ft]' (make ft)") from None
    return torchft


class ReplicaGroup:
    """The Manager of this group, built once per worker start."""

    def __init__(self, cfg: Config, env: WorkerIdentity, device: torch.device,
                 save: Callable[[], dict[str, Any]], load: Callable[[dict[str, Any]], None]):
        torchft = _torchft()
        t = Timeouts.of(cfg.distributed.replica_timeout_s)
        pg_class = torchft.ProcessGroupNCCL if device.type == "cuda" else torchft.ProcessGroupGloo
        addr, port, self._own_store = _group_store(env)
        self.group_id = env.replica_group or 0
        self._healed_at: int | None = None
        self.manager = torchft.Manager(
            pg=pg_class(timeout=timedelta(seconds=t.allreduce_s)),
            load_state_dict=self._loader(load), state_dict=save,
            min_replica_size=1, use_async_quorum=False,
            timeout=timedelta(seconds=t.manager_s),
            quorum_timeout=timedelta(seconds=t.quorum_s),
            connect_timeout=timedelta(seconds=t.manager_s),
            rank=env.rank, world_size=env.world_size, store_addr=addr, store_port=port,
            lighthouse_addr=env.lighthouse, replica_id=f"group_{self.group_id}",
            hostname=env.replica_addr or "127.0.0.1",
            checkpoint_transport=_weights_only_transport(timedelta(seconds=t.manager_s),
                                                         env.replica_addr))
        _quiet_heal_server(self.manager)
        self._quorums = _RecordingClient(self.manager._client)
        self.manager._client = self._quorums
        self._lighthouse, self._gloo = env.lighthouse, device.type != "cuda"
        # the Lighthouse drops a group silent for heartbeat_ms from the next quorum; a
        # margin over it, so that the quorum after a step given up lacks that group
        self._stale_s = t.heartbeat_ms / 1000 + 0.25
        self._began = time.monotonic()
        self._given_up: list[tuple[Any, Any]] = []  # (gloo group, its pending operation)
        # the group's ranks watch each other: the Lighthouse hears its rank 0 alone
        self._pulse = GroupPulse(env.master_addr, int(env.master_port), env.rank,
                                 env.world_size, self.group_id, self._stale_s,
                                 env.replica_addr) \
            if env.world_size > 1 and env.master_addr and env.master_port else None

    def _loader(self, load: Callable[[dict[str, Any]], None]):
        def heal(state: dict[str, Any]) -> None:
            load(state)
            self._healed_at = self.manager.current_step()
        return heal

    def start_at(self, step: int) -> None:
        """After a resume: the Manager counts from the checkpoint's step."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def quorum(self) -> Quorum:
        """Join this step's quorum (healing first when behind)."""
        self._healed_at = None
        self._given_up = [(pg, work) for pg, work in self._given_up if not work.is_completed()]
        self._began = time.monotonic()
        if self._pulse:
            self._pulse.arm()
        self.manager.start_quorum()
        rank = self.manager.participating_rank()
        return Quorum(participant=rank if rank is not None else 0,
                      participants=max(1, self.manager.num_participants()),
                      step=self.manager.current_step(), healed=self._healed_at is not None,
                      members=self._quorums.members(), quorum_id=self._quorums.quorum_id())

    def sum(self, flat: torch.Tensor) -> None:
        """Sum ``flat`` over the quorum's groups, in place (zeros after a failure, which
        :meth:`commit` then refuses). On gloo, given up as soon as the Lighthouse shows
        a group of the step frozen or cut off (:mod:`train.distributed.replica_watch`)."""
        work = self.manager.allreduce(flat, reduce_op=ReduceOp.SUM)
        inner = getattr(work, "_work", None)  # gloo's own; torchft's wrapper waits on it
        if self._lighthouse and self._gloo and inner is not None:
            done = threading.Event()
            inner.get_future().add_done_callback(lambda _: done.set())
            reason = replica_watch.wait_or_lost(done, self._look)
            if reason is not None:
                # gloo's wait cannot be cut short: the operation ends on its own (the lost
                # group back, or the timeout). Its process group is kept until then:
                # torchft drops it at the next quorum, and dropping the last reference
                # to a gloo group waits for its pending operations.
                self._given_up.append((getattr(self.manager._pg, "_pg", None), inner))
                self.manager.report_error(PeerLost(reason))
                return
        work.wait()

    def _look(self, members: bool = True) -> str | None:
        status = replica_watch.read_status(self._lighthouse)
        if status is None:
            return None
        return replica_watch.why_lost(status, self._quorums.replica_ids() if members else [],
                                      f"group_{self.group_id}", self._quorums.quorum_id(),
                                      self._stale_s)

    def commit(self) -> bool:
        """Whether this step may be applied: nothing failed here or in the all-reduce.
        A step that took longer than a group may stay silent (this process was frozen
        or cut off in it, or the step is merely long) is applied only if the Lighthouse
        still has this step's quorum: the others may have given the step up and trained
        it again without this group, and an all-reduce they left pending can still end
        here when this group comes back."""
        if self._lighthouse and self._gloo and \
                time.monotonic() - self._began > self._stale_s:
            reason = self._look(members=False)
            if reason is not None:
                self.manager.report_error(PeerLost(reason))
        committed = self.manager.should_commit()
        if self._pulse:
            self._pulse.disarm()
        return committed

    def failure(self) -> str | None:
        """Why this step failed here, in one line (gloo's error without its advice)."""
        error = self.manager.errored()
        if error is None:
            return None
        text = str(getattr(error, "original_exception", error)).strip()
        text = re.sub(r"^\[[^\]]*\]\s*", "", text)  # gloo's [source file:line]
        return text.split(". This is typically")[0].splitlines()[0]

    def close(self) -> None:
        if self._pulse:
            self._pulse.close()
        self.manager.shutdown(wait=False)


class PeerLost(RuntimeError):
    """A step's all-reduce given up: a group in it is frozen or cut off."""


class _RecordingClient:
    """The Manager's client of its quorum server, keeping the last quorum's replica ids
    (the Manager uses them and drops them): which groups a quorum has, to name those it
    lacks."""

    def __init__(self, client: Any):
        self._client = client
        self._last: Any = None

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        self._last = self._client._quorum(*args, **kwargs)
        return self._last

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def quorum_id(self) -> int:
        return int(getattr(self._last, "quorum_id", -1))

    def replica_ids(self) -> list[str]:
        """The replica ids of the last quorum (``group_G:<uuid>``)."""
        return list(getattr(self._last, "replica_ids", None) or [])

    def members(self) -> tuple[int, ...]:
        """The group ids of the last quorum."""
        found = (re.search(r"group_(\d+)", i) for i in self.replica_ids())
        return tuple(int(m[1]) for m in found if m)


def _weights_only_transport(timeout: timedelta, addr: str | None = None):
    """torchft's HTTP heal transport, reading what a peer sends as the project reads a
    checkpoint: ``weights_only`` (tensors and plain values; torchft's own unpickles
    anything, so any process that reached the heal port could run code here). It
    advertises ``addr`` (``TRAIN_REPLICA_ADDR``) where torchft's names this host: a
    Kubernetes pod's hostname does not resolve from the other pods, its IP is reached."""
    import urllib.request

    from torch.distributed._serialization import _streaming_load
    from torchft.checkpointing.http_transport import HTTPTransport

    class WeightsOnlyHTTPTransport(HTTPTransport):
        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                return _streaming_load(f, weights_only=True)

        def address(self) -> str:
            if not addr:
                return super().address()
            host = f"[{addr}]" if ":" in addr else addr
            return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

    return WeightsOnlyHTTPTransport(timeout=timeout, num_chunks=0)


def _quiet_heal_server(manager) -> None:
    """torchft's heal server logs every request to stderr like a web server; a heal is
    said once by the loop instead."""
    server = getattr(getattr(manager, "_checkpoint_transport", None), "_server", None)
    handler = getattr(server, "RequestHandlerClass", None)
    if handler is not None:
        handler.log_message = lambda *args, **kwargs: None


def _group_store(env: WorkerIdentity) -> tuple[str, int, TCPStore | None]:
    """The group's TCP store: its process group's (rank 0's, at MASTER_ADDR:MASTER_PORT),
    else, for a group of one process (no process group, and the launcher keeps
    torchrun's own store private), one of its own. Either listens on every interface:
    its address is the one the other groups reach this node at (``TRAIN_REPLICA_ADDR``),
    since the Manager advertises it for the cross-group process group's store. A group
    of several nodes meets at rank 0's node: ``MASTER_ADDR``, its address for them."""
    if env.world_size > 1 and env.master_addr and env.master_port:
        spans_nodes = env.local_world_size < env.world_size
        addr = env.master_addr if spans_nodes else env.replica_addr or env.master_addr
        return addr, int(env.master_port), None
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return env.replica_addr or "127.0.0.1", store.port, store
