"""Who is in each step of replica groups: the first step's wait for every group started
with the job (counted in the Lighthouse's rounds, so that the groups there begin
together), a restarted group's rejoining, and the lines that name the groups a quorum
lacks. The step itself: :mod:`train.loop.replica_loop`."""

from __future__ import annotations

import logging
import math
import time

import torch
import torch.distributed as dist

from train.core.files import finished_step
from train.core.run.replica_contract import QUORUM_TICK_MS
from train.distributed.replica_group import Quorum, ReplicaGroup
from train.loop.components import Components

log = logging.getLogger("train")


def first_quorum(group: ReplicaGroup, expected: int, wait_s: float, start: int) -> Quorum:
    """The first step's quorum, once every group started with the job is in it, or once
    quorums of the same groups have followed each other for ``wait_s`` (counted in the
    Lighthouse's rounds, not by each group's clock: every group in those quorums counts
    the same rounds, so all of them end the wait at the same quorum; a group that comes
    later joins a later step and heals). A group that joins a job that trains already
    (the others are past ``start``, the step it resumed at) must not wait, since the
    others count it in their quorum and their all-reduce would wait for it."""
    quorum = group.quorum()
    if quorum.participants < expected and not joins_running(quorum, start) and wait_s > 0:
        log.info("waiting up to %.0f s for %d replica groups (%d there)", wait_s, expected,
                 quorum.participants)
    rounds, same = math.ceil(wait_s * 1000 / QUORUM_TICK_MS), 0
    while quorum.participants < expected and not joins_running(quorum, start) and \
            same < rounds:
        last = (quorum.quorum_id, quorum.participants)
        # a round a tick: well within the Lighthouse's join wait, so that the groups'
        # next requests meet in one quorum again
        time.sleep(QUORUM_TICK_MS / 1000)
        quorum = group.quorum()
        same = same + 1 if (quorum.quorum_id, quorum.participants) == last else 0
    return quorum


def rejoin(group: ReplicaGroup, expected: int, wait_s: float) -> Quorum:
    """The first quorum of a group torchrun restarted. The other groups train on, but may
    be a moment away from the quorum (saving a checkpoint, evaluating, finishing the
    run): alone in it, the group asks again, up to ``wait_s`` (in the Lighthouse's
    rounds: every rank of the group stops asking at the same one), before it takes itself
    for the last one left and trains on from its checkpoint (rewriting the ledger's lines
    after it). It must not wait once it is with others: they count it in this step."""
    quorum = group.quorum()
    if quorum.participants == 1 < expected:
        log.info("restarted alone in the quorum: waiting up to %.0f s for the other replica "
                 "groups", wait_s)
    rounds = math.ceil(wait_s * 1000 / QUORUM_TICK_MS)
    while quorum.participants == 1 < expected and rounds > 0:
        time.sleep(QUORUM_TICK_MS / 1000)
        quorum, rounds = group.quorum(), rounds - 1
    return quorum


def joins_running(quorum: Quorum, start: int) -> bool:
    """This group healed from peers that trained past ``start`` (the step it began at).
    Every group but the first heals once at a job's start too (torchft's initial sync),
    from peers at the same step: that is not joining a running job."""
    return quorum.healed and quorum.step > start


def finished_without_us(c: Components, quorum: Quorum, expected: int) -> bool:
    """Alone in the quorum after the other groups finished the run (this group thawed or
    restarted too late): it must not train the run's end again on its own. Every rank of
    the group sees the same quorum, but each reads the run's result on its own, so one
    may read it a moment before another: the group takes the answer of any of its ranks,
    and all of them stop at the same step."""
    if not quorum.participants == 1 < expected:
        return False
    seen = finished_step(c.run_dir, c.cfg.train.max_steps) is not None
    if any_rank(seen, c.device):
        log.info("the other replica groups finished the run; nothing left to do here")
        return True
    return False


def any_rank(flag: bool, device: torch.device) -> bool:
    """``flag`` of any rank of this group's process group (itself when it has one
    process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    value = torch.tensor([float(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def say_membership(c: Components, quorum: Quorum, expected: int, seen: int) -> int:
    """One line when the number of groups in the quorum changes (a group lost, a spare
    or a restarted group back), from the step's writer; returns the new number."""
    if quorum.participants != seen and quorum.participant == 0 and c.env.is_main:
        step = quorum.step + 1
        if quorum.participants < expected:
            log.warning("step %d: %d of %d replica groups in the quorum, without %s (they "
                        "heal and join when they are back)", step, quorum.participants,
                        expected, absent(quorum, expected))
        else:
            log.info("step %d: all %d replica groups in the quorum again", step, expected)
    return quorum.participants


def say_absent(c: Components, quorum: Quorum, expected: int, waited_s: float,
               start: int) -> None:
    """After the first step's wait: which groups started with the job never came (a spare
    whose node never started, a group stuck before its first step), from the writer."""
    if quorum.participants >= expected or joins_running(quorum, start) or waited_s <= 0 or \
            quorum.participant != 0 or not c.env.is_main:
        return
    log.warning("%s did not join within %.0f s (distributed.replica_timeout_s); training "
                "with %d of %d replica groups (one that comes later heals and joins)",
                absent(quorum, expected), waited_s, quorum.participants, expected)


def absent(quorum: Quorum, expected: int) -> str:
    """The groups of the job not in ``quorum``, in words."""
    missing = [g for g in range(expected) if g not in quorum.members]
    if not quorum.members or not missing:
        return f"{expected - quorum.participants} replica group(s)"
    return ("replica group " if len(missing) == 1 else "replica groups ") + \
        ", ".join(map(str, missing))
