"""SLURM's hostlist syntax, expanded: ``gpu[01-04,07],cpu3`` is gpu01 .. gpu04, gpu07
and cpu3, in that order.

SLURM gives a job's nodes as a hostlist (``SLURM_JOB_NODELIST``, ``SLURM_STEP_NODELIST``);
``scontrol show hostnames`` expands it, but it is not on every node and not in every
container, so the launcher reads the syntax itself (as described in SLURM's
``hostlist_create``): names separated by commas at the top level, each name a sequence
of literal text and bracketed ranges ``[a-b,c,...]``; a range keeps its zero padding
(``[08-10]`` is 08, 09, 10), and several brackets in one name form every combination
(``r[1-2]n[1-2]`` is r1n1, r1n2, r2n1, r2n2). Anything else is a ValueError saying
what is wrong.
"""

from __future__ import annotations

import itertools
import math
import re

MAX_HOSTS = 100_000  # more nodes than any cluster: a typo like [1-999999999]
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand(hostlist: str) -> list[str]:
    """Every host of ``hostlist`` in order; ValueError for a malformed one."""
    hosts: list[str] = []
    for name in _split_top_level(hostlist.strip()):
        parts = _parts(name)
        if len(hosts) + math.prod(len(p) for p in parts) > MAX_HOSTS:
            raise ValueError(f"more than {MAX_HOSTS} hosts")
        hosts.extend("".join(combo) for combo in itertools.product(*parts))
    if not hosts:
        raise ValueError("no hosts")
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split at the commas outside brackets."""
    names, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError("nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("']' without '['")
        elif ch == "," and depth == 0:
            names.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError("'[' without ']'")
    names.append(text[start:])
    if any(not n.strip() for n in names):
        raise ValueError("an empty name between commas")
    return [n.strip() for n in names]


def _parts(name: str) -> list[list[str]]:
    """A name as a list of alternatives per position: literal text, or a range's values."""
    parts: list[list[str]] = []
    for token in re.finditer(r"\[([^\]]*)\]|[^\[\]]+", name):
        if token.group(0).startswith("["):
            if not token.group(1).strip():
                raise ValueError(f"empty brackets in {name!r}")
            parts.append(_values(token.group(1)))
        else:
            parts.append([token.group(0)])
    return parts


def _values(ranges: str) -> list[str]:
    values: list[str] = []
    for item in ranges.split(","):
        m = _RANGE.match(item.strip())
        if not m:
            raise ValueError(f"{item!r} is not a number or a range a-b")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"range {item!r} runs backwards")
        if int(hi) - int(lo) >= MAX_HOSTS:
            raise ValueError(f"range {item!r} has more than {MAX_HOSTS} hosts")
        width = len(lo) if lo.startswith("0") else 0  # [08-10]: keep two digits
        values.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return values
