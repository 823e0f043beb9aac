"""Parallel strategies this machine cannot run: exit 3 with one line. The strategies and
memory savers running on CPU with real processes: tests/e2e/test_strategies_runs.py."""

from __future__ import annotations

import pytest

from tests.harness.runs import run_train, strategy_config


@pytest.mark.parametrize("strategy,nproc,fragment", [
    ("dp", 1, "dp needs GPUs"),
    ("single", 2, "runs one process"),
])
def test_strategies_this_machine_cannot_run_exit_3(tmp_path, strategy, nproc, fragment):
    proc = run_train(strategy_config(tmp_path), f"distributed.strategy={strategy}", nproc=nproc)
    assert fragment in proc.stderr
    if nproc == 1:
        assert proc.returncode == 3
        assert len(proc.stderr.strip().splitlines()) == 1
    else:  # bare torchrun reports any worker exit as 1; entrypoint.py refuses it up front
        assert proc.returncode != 0
