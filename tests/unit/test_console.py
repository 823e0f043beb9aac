"""What a person watching a run sees: a bar that moves every step, a steady ETA,
warnings on their own lines, one line for the launcher's variables, a closing summary,
the first step logged, and "nothing to do" decided before anything is built."""

from __future__ import annotations

import io
import logging
import re
import subprocess
import sys

import pytest

from tests.harness.runs import ROOT, TINY_GPT, clean_env, limit, merge, read_metrics, write_config
from train.observe import console as console_mod
from train.observe.console import Console, StepRate


class Clock:
    """Stands for time.perf_counter: the tests decide how long each step took."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(console_mod.time, "perf_counter", fake)
    return fake


def test_bar_moves_every_step_between_logging_rows(clock):
    out = io.StringIO()
    con = Console(max_steps=20, unit="tokens", bar=True, out=out)
    for step in range(1, 11):
        clock.now += 1.0  # slower than the redraw limit: every step is drawn
        con.step(step)
        if step % 5 == 0:
            con.row(step, {"loss": 2.0}, step_time=1.0)
    con.close()
    drawn = [frame.split("] ")[1].split(" |")[0] for frame in out.getvalue().split("\r")[1:]]
    assert [f"step {s}/20" for s in range(1, 11)] == sorted(set(drawn), key=lambda d: int(
        d.split()[1].split("/")[0]))
    assert out.getvalue().endswith("\n")


def test_bar_redraws_at_most_ten_times_a_second(clock):
    out = io.StringIO()
    con = Console(max_steps=1000, unit="tokens", bar=True, out=out)
    for step in range(1, 101):
        clock.now += 0.001  # 100 steps in 0.1 s
        con.step(step)
    assert out.getvalue().count("\r") <= 2


def test_eta_is_smoothed_and_ignores_the_first_step(clock):
    rate = StepRate()
    clock.now = 30.0  # the first step paid for start-up: baseline only
    rate.update(1, clock.now)
    assert rate.eta(10) == float("inf")
    estimates = []
    for step in range(2, 202):
        clock.now += 1.0 if step % 20 < 10 else 3.0  # windows alternate fast / slow
        rate.update(step, clock.now)
        estimates.append(rate.seconds_per_step)
    settled = estimates[100:]
    assert min(settled) > 1.0 and max(settled) < 3.0
    # a raw per-window estimate would swing between 1 and 3 s; the smoothed one much less
    assert max(settled) - min(settled) < 1.5
    # updates every 5 steps give the same estimate as updates every step
    sparse = StepRate()
    t = 30.0
    sparse.update(1, t)
    for step in range(2, 202):
        t += 1.0 if step % 20 < 10 else 3.0
        if step % 5 == 1:
            sparse.update(step, t)
    assert abs(sparse.seconds_per_step - estimates[-1]) < 0.35


def test_warnings_never_land_on_the_bar_line(clock):
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logging.getLogger().addHandler(handler)
    try:
        con = Console(max_steps=10, unit="tokens", bar=True, out=out)
        clock.now += 1.0
        con.step(1)
        logging.getLogger("train").warning("something to see")
        con.close()
    finally:
        logging.getLogger().removeHandler(handler)
    lines = out.getvalue().split("\n")
    warning = next(line for line in lines if "something to see" in line)
    assert warning == "something to see"  # its own line, nothing of the bar before it


def test_a_run_logs_step_one_summarises_its_variables_and_closes_with_a_summary(tmp_path):
    runs = tmp_path / "runs"
    config = write_config(tmp_path / "t.yaml", merge(TINY_GPT, {
        "output": {"dir": str(runs)}, "logging": {"every_steps": 5}}))
    entry = [sys.executable, str(ROOT / "entrypoint.py"), "train", str(config)]
    env = clean_env()
    first = subprocess.run(entry, cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=limit(240))
    assert first.returncode == 0, first.stderr[-3000:]
    assert not [ln for ln in first.stderr.splitlines() if ln.startswith("entrypoint: set ")]
    summary, = [ln for ln in first.stderr.splitlines() if "workers get" in ln]
    assert re.fullmatch(r"entrypoint: workers get OMP_NUM_THREADS=\d+, .*plus \d+ standard "
                        r"variables \(ranks, addresses, Python's settings\); --verbose lists "
                        r"them all", summary), summary
    assert [r["step"] for r in read_metrics(runs / "t") if "loss" in r] == [1, 5, 10]
    done = first.stdout[first.stdout.index("done: "):]
    assert "step 10/10" in done and "val/loss" in done
    assert "runs/t" in done and "entrypoint.py export runs/t" in done
    assert "tensorboard --logdir runs" in done

    more = subprocess.run([*entry, "train.max_steps=12", "--verbose"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=limit(240))
    assert more.returncode == 0, more.stderr[-3000:]
    verbose = [ln for ln in more.stderr.splitlines() if ln.startswith("entrypoint: set ")]
    assert len(verbose) > 5 and any(ln.startswith("entrypoint: set WORLD_SIZE=") for ln in verbose)

    again = subprocess.run([sys.executable, "-m", "train", str(config), "train.max_steps=12"],
                           cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)},
                           capture_output=True, text=True, timeout=limit(240))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing to do" in again.stderr
    assert "parameters" not in again.stderr  # decided before the model and data were built
