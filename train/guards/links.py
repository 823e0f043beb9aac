"""The preflight check's link timing: each node against a few peer nodes, in pairs.

Rules and wording are :mod:`train.core.nodes.link_rule`'s; this is the torch side, run by every
rank of a multi-node start after the matmul and all-reduce (:mod:`train.guards.preflight`),
once every rank's node and local rank are known. In each round of
:func:`train.core.nodes.link_rule.schedule` a rank exchanges :data:`LINK` bytes both ways at once
with the rank of the same local rank on its node's peer (a send and a receive posted
together: ``batch_isend_irecv``, which NCCL needs to avoid a deadlock and gloo takes
too), a warm-up and :data:`REPEATS` timed exchanges, and keeps the fastest: a process
starved of CPU (a busy node) only adds its waits to an exchange, now and then, while a
link held back (a bad NIC, tc) is slow every time, so the fastest is the link's. A rank with
no peer in a round (an odd number of nodes, or no rank of its local rank on the peer
node) sits it out. Each exchange is a part of the watched ``preflight`` phase, so a
link that never delivers is named by the hang watchdog like a stuck all-reduce.

Bounded: at most :data:`~train.core.nodes.link_rule.ROUNDS` rounds of 1 + :data:`REPEATS`
exchanges, whatever the size of the job.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from train.core.nodes import link_rule as rule
from train.core.nodes.verdict import RankResult

# float32 elements each way: 1 MiB on CPUs (gloo), 64 MiB on GPUs (a NIC's bandwidth
# shows only with a large message).
LINK = {"cpu": 256 * 1024, "cuda": 16 * 1024 * 1024}
WARMUP, REPEATS = 1, 3


def measure(results: Sequence[RankResult], me: RankResult, device: torch.device,
            progress: Callable[[], None] = lambda: None) -> tuple[tuple[int, float], ...]:
    """(peer node, fastest ms) for every round this rank had a partner in. Collective
    over the pairs: every rank of the job calls it with the same ``results``."""
    layout = {(r.node, r.local_rank): r.rank for r in results}
    nodes = sorted({r.node for r in results})
    index = {node: i for i, node in enumerate(nodes)}  # schedule seats: 0..len(nodes)-1
    out = []
    numel = LINK.get(device.type, LINK["cpu"])
    mine, theirs = torch.ones(numel, device=device), torch.empty(numel, device=device)
    for pairs in rule.schedule(len(nodes)):
        seat = pairs.get(index[me.node])
        peer_node = nodes[seat] if seat is not None else None
        peer = rule.partner(me.node, me.local_rank, peer_node, layout) \
            if peer_node is not None else None
        if peer is not None:
            out.append((peer_node, _exchange(mine, theirs, peer, device, progress)))
    return tuple(out)


def _exchange(mine: torch.Tensor, theirs: torch.Tensor, peer: int, device: torch.device,
              progress: Callable[[], None]) -> float:
    """The fastest timed exchange with ``peer``, in milliseconds.

    Each exchange ends with a one-element acknowledgement both ways, sent once this
    side has received the peer's tensor: a send counts as done when the kernel has
    buffered it, so without it the side whose outgoing link is held back (tc on its
    egress, a bad NIC's transmit) would time only its fast receive and its buffered
    send, and the pair, judged by its faster side, would look healthy."""
    done, ack = torch.ones(1, device=device), torch.empty(1, device=device)
    times = []
    for i in range(WARMUP + REPEATS):  # the warm-up waits for the peer to arrive
        _sync(device)
        start = time.perf_counter()
        for pair in ((mine, theirs), (done, ack)):
            ops = [dist.P2POp(dist.isend, pair[0], peer), dist.P2POp(dist.irecv, pair[1], peer)]
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        _sync(device)
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
        progress()
    return min(times) * 1000


def nbytes(device: torch.device) -> int:
    """Bytes each way per exchange."""
    return LINK.get(device.type, LINK["cpu"]) * 4


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
