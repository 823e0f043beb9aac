"""The GPU check (tools/gpu_check.py) running its stop and speed stages for real on the
CPU. The rest of the tooling: tests/unit/test_tools.py."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.harness.runs import ROOT, clean_env, limit


def test_gpu_check_runs_its_stop_and_speed_stages_on_the_cpu(tmp_path):
    """GPU_CHECK_FORCE_CPU runs the GPU stages' own code on this machine: a SIGTERM mid-run
    must end in 143 with a checkpoint, and the throughput bench must give its table, both
    recorded as ok (so a GPU loan is not spent finding a broken stage)."""
    out = subprocess.run([str(ROOT / "scripts/gpu-check")], cwd=tmp_path, timeout=limit(480),
                         env=clean_env(PYTHON=sys.executable, OUT=str(tmp_path / "out"),
                                       GPU_CHECK_FORCE_CPU="1", GPU_CHECK_ONLY="stop,speed"),
                         capture_output=True, text=True)
    rows = [json.loads(x) for x in (tmp_path / "out/stages.jsonl").read_text().splitlines()]
    assert [r["name"] for r in rows] == ["deps", "doctor", "stop", "speed"], \
        out.stdout + out.stderr
    stop, speed = rows[-2:]
    assert stop["ok"] and stop["rc"] == 143 and "checkpoint step-" in stop["note"], stop
    assert speed["ok"] and speed["note"].startswith("CPU, "), speed
    assert "plain loop x1 " in speed["note"] and "trainer x1 " in speed["note"], speed
    assert out.returncode == 0
