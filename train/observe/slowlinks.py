"""A link that slows mid-run is named: which node, on which host.

A node whose NIC or cable slows after the start (a port that renegotiates a lower speed,
a congested switch) slows every collective, and every rank waits alike in it: the
straggler judge (:mod:`train.observe.stragglers`) compares ranks with each other and sees
no one. What does change is the job's *communication wait*: the part of a step that no
rank's data or compute explains. The slowest rank's step time less its own data and
compute is that wait (a slow rank's peers wait for it, the slowest waits only for the
network), so a straggler does not move it, and a machine-wide slowdown of compute makes
its share of the step smaller, not larger.

Detection rides on the gather every logging step already makes (each rank's step, data
and compute time): rank 0 keeps a window of the last ``logging.straggler_steps`` steps
(and at least :data:`~train.observe.stragglers.WINDOW_S` seconds), takes the first full
window as the run's baseline, and says the wait grew when, against that baseline, the
window's median wait grew ``logging.straggler_ratio`` times more than the rest of the step
did, and the growth costs at least :data:`~train.observe.stragglers.MIN_COST` of a step.
Compute slowing on every rank grows the rest, not the wait; a machine slow in everything
grows both alike; one slow interval moves no median. (A share of the step would not do:
a job already mostly waiting, 60 % say, could never reach 1.3 times its share.)

Attribution: rank 0 then sets a flag in its row of the next logging gather, and every
rank, having seen it in the same gather, runs the preflight's bounded pairwise link
timing (:func:`train.guards.links.measure`) at the same step; rank 0 judges it with the
preflight's rule (:func:`train.core.nodes.link_rule.slow_nodes`, three nodes or more). Two nodes
share one link, so there the link is compared with its own earlier speed: the
preflight's, or else a timing made once when the baseline is set. At most one check every
:data:`CHECK_EVERY_S`; training goes on whatever it finds.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from train.core.nodes import link_rule as rule
from train.core.nodes.verdict import RankResult
from train.core.run.identity import WorkerIdentity
from train.distributed import ranks
from train.guards import links
from train.observe.stragglers import FLOOR_S, MIN_COST, window_covers

log = logging.getLogger("train")

CHECK_EVERY_S = 60.0  # link checks, at most: each costs a few exchanges per node pair


@dataclass
class CommWait:
    """Rank 0's detector: :meth:`observe` every logging interval."""
    ratio: float
    steps: int
    window: deque = field(default_factory=deque)  # (steps, wait s, step time s)
    baseline: tuple[float, float] | None = None   # (wait s, the rest of a step s)
    grown_by: float = 1.0     # how much more the wait grew than the rest of the step
    seen: int = 0

    def observe(self, interval: int, per_rank: Sequence[tuple[float, float, float]],
                step_time: float) -> bool:
        """``per_rank``: each rank's (step, data, compute) seconds per step over the last
        ``interval`` steps. True while the window's wait has grown well above the
        baseline's."""
        self.seen += 1
        if self.ratio <= 0 or self.seen == 1:  # the first interval holds the start-up
            return False
        wait = max(0.0, min(t - d - c for t, d, c in per_rank))
        self.window.append((interval, wait, step_time))
        while window_covers([(n, t) for n, _, t in list(self.window)[1:]], self.steps):
            self.window.popleft()
        if not window_covers([(n, t) for n, _, t in self.window], self.steps):
            return False
        wait = statistics.median(w for _, w, _ in self.window)
        step = statistics.median(t for _, _, t in self.window)
        rest = max(step - wait, 0.0)
        if self.baseline is None:
            self.baseline = (wait, rest)
            return False
        base_wait, base_rest = self.baseline
        self.grown_by = (wait / max(base_wait, FLOOR_S)) / (max(rest, FLOOR_S) /
                                                            max(base_rest, FLOOR_S))
        return self.grown_by >= self.ratio and wait - base_wait >= MIN_COST * step


@dataclass(frozen=True)
class LinkFinding:
    """A node (or, with two nodes, their link) named slow, or fast again, at ``step``."""
    TAG: ClassVar[str] = "slow_links"
    step: int
    node: int                 # -1: the link between the two nodes of a two-node job
    host: str
    ratio: float              # its speed / the comparison's (0: it keeps pace again)
    mbps: float               # MB/s each way, its best link
    others_mbps: float        # the other nodes' median best, or this link's earlier speed
    against: str              # "other nodes" | "preflight" | "earlier"
    seconds: float            # the link check's wall time on rank 0

    def line(self) -> str:
        if not self.ratio:
            return f"slow link: {self._where()} keeps pace again at step {self.step}"
        speeds = f"{self.mbps:.3g} vs {self.others_mbps:.3g} MB/s each way"
        if self.against == "other nodes":
            return (f"slow link: {self._where()} links {_times(self.ratio)}x the other nodes' "
                    f"({speeds}, its fastest peer) at step {self.step}; every step waits "
                    f"for it")
        return (f"slow link: {self._where()} runs at {_times(self.ratio)}x its {self.against} "
                f"speed ({speeds}) at step {self.step}; two nodes: nothing tells which end")

    def _where(self) -> str:
        return f"node {self.node} ({self.host})" if self.node >= 0 else \
            f"the link between node 0 and node 1 ({self.host})"

    def record(self) -> dict:
        return {"step": self.step, "event": "slow_link" if self.ratio else "slow_link_over",
                "node": self.node, "host": self.host, "ratio": round(self.ratio, 3),
                "mbps": round(self.mbps, 3), "others_mbps": round(self.others_mbps, 3),
                "against": self.against, "check_seconds": round(self.seconds, 3)}


def _times(ratio: float) -> str:
    """0.25, or 0.004 where two decimals would say 0.00."""
    return f"{ratio:.2f}" if ratio >= 0.01 else f"{ratio:.1g}"


class SlowLinks:
    """Detection on rank 0, the link check on every rank when rank 0 asks for it."""

    def __init__(self, ratio: float, steps: int, slow_ratio: float, env: WorkerIdentity,
                 layout: Sequence[RankResult], device: torch.device,
                 preflight: dict[tuple[int, int], float] | None = None):
        self.env, self.layout, self.device = env, list(layout), device
        self.nodes = len({r.node for r in self.layout})
        self.on = ratio > 0 and self.nodes > 1
        self.detector = CommWait(ratio, steps)
        self.slow_ratio = slow_ratio
        self.baseline = dict(preflight or {})  # pair -> ms: two nodes' earlier speed
        self.against = "preflight" if self.baseline else "earlier"
        self.wanted = False                    # rank 0: a check at the next gather
        self.last_check = -CHECK_EVERY_S
        self.named: list[LinkFinding] = []

    def flag(self) -> float:
        """Rank 0's column in the logging gather: 1 asks every rank for a check."""
        return float(self.wanted)

    def observe(self, step: int, interval: int, per_rank: Sequence[tuple[float, float, float]],
                step_time: float) -> list[LinkFinding]:
        """Rank 0, after a logging gather: asks for a check when the wait grew (or, with
        two nodes and no preflight, once for the baseline); says a named node keeps pace
        once the wait is back."""
        if not self.on:
            return []
        had_baseline = self.detector.baseline is not None
        grown = self.detector.observe(interval, per_rank, step_time)
        if not had_baseline and self.detector.baseline is not None:
            wait, rest = self.detector.baseline
            log.info("slow links: the communication wait is %.0f ms a step, the rest %.0f ms, "
                     "up to step %d: the baseline a slow link is told by", wait * 1000,
                     rest * 1000, step)
            if self.nodes == 2 and not self.baseline:
                self.wanted = True  # the link's own speed, while nothing is wrong
        if grown and not self.named and time.monotonic() - self.last_check >= CHECK_EVERY_S:
            self.wanted = True
        if not grown and self.named:
            over = [LinkFinding(step, f.node, f.host, 0.0, 0.0, 0.0, f.against, 0.0)
                    for f in self.named]
            self.named = []
            return over
        return []

    def check(self, step: int) -> list[LinkFinding]:
        """Collective, every rank at the same step: the preflight's link timing; rank 0
        judges it (others get nothing)."""
        started = time.perf_counter()
        self.wanted, self.last_check = False, time.monotonic()
        me = self.layout[self.env.rank]
        mine = links.measure(self.layout, me, self.device)
        gathered = ranks.gather(self.env)((me.node, mine))
        seconds = time.perf_counter() - started
        if not self.env.is_main:
            return []
        times = rule.pair_times((node, peer, ms) for node, timed in gathered
                                for peer, ms in timed)
        if self.nodes == 2 and not self.baseline:  # the first timing: the link's own speed
            self.baseline = times
            log.info("slow links: the link between node 0 and node 1 ran at %s at step %d: "
                     "the speed a later check is compared with", self._speeds(times), step)
            return []
        self.named = self._judge(step, times, seconds)
        if not self.named:
            log.info("slow links: the communication wait grew %.1fx more than the rest of "
                     "the step since the baseline; links timed at step %d in %.1f s: %s; "
                     "no node stands out", self.detector.grown_by, step, seconds,
                     self._speeds(times))
        return self.named

    def _judge(self, step: int, times: dict[tuple[int, int], float],
               seconds: float) -> list[LinkFinding]:
        nbytes = links.nbytes(self.device)
        if self.nodes == 2:
            return self._judge_pair(step, times, seconds, nbytes)
        return [LinkFinding(step, node, self._host(node), others / ms,
                            rule.speed(nbytes, ms), rule.speed(nbytes, others),
                            "other nodes", seconds)
                for node, ms, others, _ in rule.slow_nodes(times, self.slow_ratio)]

    def _judge_pair(self, step: int, times: dict[tuple[int, int], float], seconds: float,
                    nbytes: int) -> list[LinkFinding]:
        found = []
        for pair, ms in times.items():
            base = self.baseline.get(pair)
            if base and base < self.slow_ratio * ms and ms - base >= rule.FLOOR_MS:
                hosts = f"{self._host(pair[0])}, {self._host(pair[1])}"
                found.append(LinkFinding(step, -1, hosts, base / ms, rule.speed(nbytes, ms),
                                         rule.speed(nbytes, base), self.against, seconds))
        return found

    def _host(self, node: int) -> str:
        return next((r.host for r in self.layout if r.node == node), "?")

    def _speeds(self, times: dict[tuple[int, int], float]) -> str:
        nbytes = links.nbytes(self.device)
        speeds = sorted(rule.speed(nbytes, ms) for ms in times.values())
        return f"{speeds[0]:.3g}-{speeds[-1]:.3g} MB/s" if speeds else "no pairs"
