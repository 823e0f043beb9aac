"""The preflight check's link rule: which node pairs to time, and which node to name.

In a ring or tree all-reduce every rank waits for the slowest link, so a node with a bad
NIC, a cable that negotiated a lower speed or a congested switch port slows every rank
alike: neither the all-reduce time nor a rank's compute time says which node it is. So
the preflight check (:mod:`train.guards.links` measures, with torch) pairs the nodes in
a few rounds, every node with one peer node per round (:func:`schedule`, a round-robin
tournament cut to :data:`ROUNDS`), and each pair exchanges a fixed-size tensor both ways
at once, timed on both sides. Every node has then been timed against up to
:data:`ROUNDS` different peers.

A node's *best* link (the fastest exchange it made with any peer) is what it is judged
by: a healthy node has at least one healthy peer, so one bad node makes only its own
links slow, and its best link is slow too. A node whose best link is below
``slow_ratio`` x the median of the other nodes' best links (and at least
:data:`FLOOR_MS` slower, so that sub-millisecond jitter names nobody) is named:
``preflight: node 2 (host-c) links 0.04x the other nodes' (9.6 vs 240 MB/s each way,
its fastest of 2 peer nodes)``. Naming needs three nodes or more: with two there is one
link, and nothing tells which end of it is slow (its speed is in the summary line).

Torch-free and pure, like :mod:`.verdict`, whose :func:`~.verdict.judge` uses it.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping

ROUNDS = 3      # peers each node is timed against, at most: a few seconds on any cluster
FLOOR_MS = 1.0  # a node's best link must also be this much slower than the others'


def schedule(nodes: int, rounds: int = ROUNDS) -> list[dict[int, int]]:
    """Up to ``rounds`` rounds, each a map node -> its peer node in that round (both
    ways); a node missing from a round sits it out (an odd count). The circle method:
    node 0 stays, the others rotate, so no pair meets twice."""
    if nodes < 2:
        return []
    seats = list(range(nodes)) + ([None] if nodes % 2 else [])
    out = []
    for r in range(min(rounds, len(seats) - 1)):
        rest = seats[1:]
        order = [seats[0]] + rest[r:] + rest[:r]
        pairs: dict[int, int] = {}
        for i in range(len(order) // 2):
            a, b = order[i], order[-1 - i]
            if a is not None and b is not None:
                pairs[a], pairs[b] = b, a
        out.append(pairs)
    return out


def partner(node: int, local_rank: int, peer_node: int,
            layout: Mapping[tuple[int, int], int]) -> int | None:
    """The global rank that exchanges with (node, local_rank) when its node meets
    ``peer_node``: the same local rank there (rail to rail, as the rings go), if any."""
    return layout.get((peer_node, local_rank)) if (node, local_rank) in layout else None


def pair_times(records: Iterable[tuple[int, int, float]]) -> dict[tuple[int, int], float]:
    """(node, peer node, ms) as each side timed it -> the pair's time: the faster side's
    (the other may also have waited for its peer to arrive)."""
    times: dict[tuple[int, int], float] = {}
    for node, peer, ms in records:
        key = (min(node, peer), max(node, peer))
        times[key] = min(ms, times.get(key, ms))
    return times


def best_links(times: Mapping[tuple[int, int], float]) -> dict[int, tuple[float, int]]:
    """node -> (its fastest pair's ms, how many peer nodes it was timed against)."""
    best: dict[int, tuple[float, int]] = {}
    for pair, ms in times.items():
        for node in pair:
            low, count = best.get(node, (ms, 0))
            best[node] = (min(low, ms), count + 1)
    return best


def slow_nodes(times: Mapping[tuple[int, int], float], slow_ratio: float
               ) -> list[tuple[int, float, float, int]]:
    """(node, its best ms, the other nodes' median best ms, its peers) for each node whose
    every link is far slower than the others' best; none with fewer than three nodes."""
    best = best_links(times)
    if len(best) < 3:
        return []
    slow = []
    for node, (ms, peers) in sorted(best.items()):
        others = statistics.median(m for n, (m, _) in best.items() if n != node)
        if ms * slow_ratio > others and ms - others >= FLOOR_MS:
            slow.append((node, ms, others, peers))
    return slow


def speed(nbytes: int, ms: float) -> float:
    """MB/s each way for ``nbytes`` exchanged in ``ms``."""
    return nbytes / (ms / 1000) / 1e6 if ms > 0 else float("inf")
