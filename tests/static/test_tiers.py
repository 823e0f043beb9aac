"""The tiers' own bookkeeping (tests/conftest.py): the slow tier's scheduling order names
every slow file once, so a renamed, removed or new file cannot silently fall to the end
of the run (where a long one would run alone while the other workers idle)."""

from __future__ import annotations

from tests.conftest import E2E, E2E_LONGEST_FIRST


def test_the_longest_first_order_names_every_slow_file_once():
    files = {p.stem for p in E2E.glob("test_*.py")}
    assert sorted(set(E2E_LONGEST_FIRST) - files) == [], "gone: remove from E2E_LONGEST_FIRST"
    assert sorted(files - set(E2E_LONGEST_FIRST)) == [], \
        "not in E2E_LONGEST_FIRST: add by its --durations seconds"
    assert len(set(E2E_LONGEST_FIRST)) == len(E2E_LONGEST_FIRST)
