"""The tiers' own bookkeeping (tests/conftest.py): the slow tier's scheduling order names
files that exist, so a renamed or removed file cannot silently fall to the end."""

from __future__ import annotations

from tests.conftest import E2E, E2E_LONGEST_FIRST


def test_the_longest_first_order_names_existing_slow_files_once():
    files = {p.stem for p in E2E.glob("test_*.py")}
    assert sorted(set(E2E_LONGEST_FIRST) - files) == []
    assert len(set(E2E_LONGEST_FIRST)) == len(E2E_LONGEST_FIRST)
