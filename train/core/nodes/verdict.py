"""The preflight check's verdict: every rank's measurements in, the lines rank 0 prints out.

Before step 1 of a multi-node run (``distributed.preflight``) and in ``doctor --comm``,
every rank times a matmul of a fixed size on its device and an all-reduce of a fixed
size with its peers (:mod:`train.guards.preflight` measures, with torch). What they
measured comes here, as one :class:`RankResult` per rank, and :func:`judge` says what is
wrong, one line each:

- a failure: the matmul gave NaN or inf, the all-reduce a wrong sum, or the check
  raised (``preflight: rank 3 (node 1, host-b) matmul gave NaN``);
- a rank far slower than the others: its matmul below ``slow_ratio`` x the median rank's
  (``preflight: node 1 (host-b) matmul 0.21x the median (3.1 vs 14.8 GFLOP/s)``). A node
  all of whose ranks are slow is named as the node; uniform slowness names nothing.

- a node whose links are all far slower than the other nodes' (a bad NIC, a congested
  port): the nodes exchange a tensor in pairs, and :mod:`train.core.nodes.link_rule` says which
  node's best link is far below the others' (``preflight: node 2 (host-c) links 0.04x
  the other nodes' (...)``); three nodes or more.

The all-reduce time is the group's (a ring waits for its slowest link, so every rank
measures about the same): it is shown as a range in the summary line, never used to
name a node. With nothing wrong, one summary line:
``preflight: 4 ranks on 2 nodes in 1.2 s: matmul 14-15 GFLOP/s, all-reduce 1 MiB 2.1-2.4 ms,
links 1 MiB 410-450 MB/s``.

Torch-free and pure, so that the launcher (``doctor --comm``) and the workers judge alike.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from train.core.nodes import link_rule

OFF, WARN, FAIL = "off", "warn", "fail"   # distributed.preflight
PREFIX = "preflight: "


@dataclass(frozen=True)
class RankResult:
    """What one rank measured. ``gflops`` is None when the matmul did not finish."""
    rank: int
    node: int = 0                      # GROUP_RANK: the node's index in the job
    host: str = "?"
    scheduler_node: str | None = None  # its scheduler's name for the node (SLURM's)
    local_rank: int = 0
    gflops: float | None = None        # matmul: the median repetition's GFLOP/s
    nonfinite: str | None = None       # matmul: "NaN" or "inf" when its result had one
    allreduce_ms: float | None = None  # all-reduce: the median repetition's time
    allreduce_bytes: int = 0
    allreduce_ok: bool = True          # every repetition summed to the world size
    error: str | None = None           # what raised, in one line
    seconds: float = 0.0               # the whole check on this rank
    # links: (peer node, the median exchange's ms) for each peer node this rank was
    # paired with; link_bytes each way per exchange
    links: tuple[tuple[int, float], ...] = ()
    link_bytes: int = 0


@dataclass(frozen=True)
class Verdict:
    failures: list[str] = field(default_factory=list)   # NaN, a wrong sum, an error
    slow: list[str] = field(default_factory=list)       # ranks far below the median, and
                                                        # nodes whose links all are
    summary: str | None = None                          # when nothing is wrong
    hosts: list[str] = field(default_factory=list)      # nodes of the ranks named
    # (node, peer node) -> the pair's exchange ms: a two-node job's mid-run link baseline
    link_times: dict[tuple[int, int], float] = field(default_factory=dict)

    @property
    def problems(self) -> list[str]:
        return self.failures + self.slow

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def lines(self) -> list[str]:
        return self.problems or ([self.summary] if self.summary else [])

    def one_line(self) -> str:
        """Every problem in one line: ``preflight: A; B``."""
        return PREFIX + "; ".join(p.removeprefix(PREFIX) for p in self.problems)


def judge(results: Sequence[RankResult], slow_ratio: float) -> Verdict:
    """The lines for these ranks' results (any order)."""
    results = sorted(results, key=lambda r: r.rank)
    failures = _failures(results)
    link_times = _pair_times(results)
    slow_links = link_rule.slow_nodes(link_times, slow_ratio)
    slow = _slow(results, slow_ratio) + _slow_link_lines(results, slow_links)
    summary = None if failures or slow else _summary(results)
    named = [r for r in results if _failure(r)] + _slow_ranks(results, slow_ratio)[1] + \
        [r for r in results if r.node in {node for node, *_ in slow_links}]
    return Verdict(failures, slow, summary,
                   sorted({r.scheduler_node or r.host for r in named}), link_times)


def _who(results: Sequence[RankResult], flagged: Sequence[RankResult]) -> str:
    """``node 1 (host-b)`` when every rank of that node is flagged, else
    ``rank 3 (node 1, host-b)`` / ``ranks 3, 5 (node 1, host-b)``."""
    node, host = flagged[0].node, flagged[0].host
    on_node = [r for r in results if r.node == node]
    if len(flagged) == len(on_node) and len({r.node for r in results}) > 1:
        return f"node {node} ({host})"
    ranks = ", ".join(str(r.rank) for r in flagged)
    return f"rank{'s' if len(flagged) > 1 else ''} {ranks} (node {node}, {host})"


def _by_node(flagged: list[tuple[RankResult, str]]) -> dict[tuple[int, str], list[RankResult]]:
    """Ranks with the same problem on the same node, together (in rank order)."""
    groups: dict[tuple[int, str], list[RankResult]] = {}
    for r, what in flagged:
        groups.setdefault((r.node, what), []).append(r)
    return groups


def _failure(r: RankResult) -> str | None:
    if r.error:
        return f"failed: {r.error}"
    if r.nonfinite:
        return f"matmul gave {r.nonfinite}"
    if not r.allreduce_ok:
        return "all-reduce gave a wrong sum"
    return None


def _failures(results: Sequence[RankResult]) -> list[str]:
    flagged = [(r, what) for r in results if (what := _failure(r)) is not None]
    return [f"{PREFIX}{_who(results, group)} {what}"
            for (_, what), group in _by_node(flagged).items()]


def _slow_ranks(results: Sequence[RankResult], slow_ratio: float
                ) -> tuple[float, list[RankResult]]:
    """(the median matmul rate, the ranks far below it) among those that measured."""
    measured = [r for r in results if r.gflops is not None and _failure(r) is None]
    if len(measured) < 2:
        return 0.0, []
    median = statistics.median(r.gflops for r in measured)
    return median, [r for r in measured if r.gflops < slow_ratio * median]


def _slow(results: Sequence[RankResult], slow_ratio: float) -> list[str]:
    measured = [r for r in results if r.gflops is not None and _failure(r) is None]
    median, slow = _slow_ranks(results, slow_ratio)
    flagged = [(r, "slow") for r in slow]
    lines = []
    for group in _by_node(flagged).values():
        worst = min(group, key=lambda r: r.gflops)
        lines.append(f"{PREFIX}{_who(measured, group)} matmul {worst.gflops / median:.2f}x "
                     f"the median ({_span((worst.gflops, median), _rate, ' vs ')})")
    return lines


def _pair_times(results: Sequence[RankResult]) -> dict[tuple[int, int], float]:
    return link_rule.pair_times((r.node, peer, ms) for r in results for peer, ms in r.links)


def _slow_link_lines(results: Sequence[RankResult],
                     slow: list[tuple[int, float, float, int]]) -> list[str]:
    nbytes = max((r.link_bytes for r in results), default=0)
    lines = []
    for node, ms, others, peers in slow:
        host = next(r.host for r in results if r.node == node)
        mine, theirs = link_rule.speed(nbytes, ms), link_rule.speed(nbytes, others)
        lines.append(f"{PREFIX}node {node} ({host}) links {mine / theirs:.2f}x the other "
                     f"nodes' ({_span((mine, theirs), _mbs, ' vs ')} each way, its fastest "
                     f"of {peers} peer node{'s' if peers > 1 else ''})")
    return lines


def _links_part(results: Sequence[RankResult]) -> str | None:
    times = list(_pair_times(results).values())
    if not times:
        return None
    nbytes = max(r.link_bytes for r in results)
    speeds = [link_rule.speed(nbytes, ms) for ms in times]
    scale = 1000 if min(speeds) >= 1000 else 1  # one unit for the range
    unit = "GB/s" if scale > 1 else "MB/s"
    return f"links {_bytes(nbytes)} {_span(speeds, lambda v: f'{_num(v / scale)} {unit}')}"


def _summary(results: Sequence[RankResult]) -> str:
    nodes = len({r.node for r in results})
    seconds = max(r.seconds for r in results)
    parts = []
    rates = [r.gflops for r in results if r.gflops is not None]
    if rates:
        parts.append(f"matmul {_span(rates, _rate)}")
    times = [r.allreduce_ms for r in results if r.allreduce_ms is not None]
    if times:
        size = _bytes(max(r.allreduce_bytes for r in results))
        parts.append(f"all-reduce {size} {_span(times, lambda v: f'{_num(v)} ms')}")
    links = _links_part(results)
    if links:
        parts.append(links)
    return (f"{PREFIX}{len(results)} rank{'s' if len(results) > 1 else ''} on {nodes} "
            f"node{'s' if nodes > 1 else ''} in {seconds:.1f} s: " + ", ".join(parts))


def _num(v: float) -> str:
    """Two or three significant figures: 2.1, 14, 148."""
    return f"{v:.0f}" if v >= 10 else f"{v:.1f}" if v >= 1 else f"{v:.2g}"


def _rate(gflops: float) -> str:
    return f"{_num(gflops / 1000)} TFLOP/s" if gflops >= 1000 else f"{_num(gflops)} GFLOP/s"


def _mbs(mb_s: float) -> str:
    return f"{_num(mb_s / 1000)} GB/s" if mb_s >= 1000 else f"{_num(mb_s)} MB/s"


def _span(values: Sequence[float], show, between: str = "-") -> str:
    """``14-15 GFLOP/s``: the lowest and highest, the unit once; with ``between`` " vs ",
    the first value against the second (``3.1 vs 15 GFLOP/s``)."""
    first, second = (min(values), max(values)) if between == "-" else values
    low, high = show(first), show(second)
    if low == high and between == "-":
        return low
    low_num, _, unit = low.partition(" ")
    high_num, _, high_unit = high.partition(" ")
    return f"{low_num}{between}{high_num} {unit}" if unit == high_unit else \
        f"{low}{between}{high}"


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"
