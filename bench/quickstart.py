"""The quick start's promises, measured: the time `make quickstart`'s training takes and
the losses it shows, against what README.md states (recorded in bench/quickstart.json
with the machine they were measured on).

Runs `entrypoint.py train configs/quickstart.yaml` as the README does (into a temporary
output folder), then prints the measurement, the recorded one and their ratios. Exit 1
when the losses drift (the config or the training changed) or the time is off by more
than 1.5x either way on a machine like the recorded one (`--record` rewrites the record
instead, after a deliberate change; update the README's numbers with it).

    python -m bench.quickstart [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORD = Path(__file__).with_suffix(".json")
LOSS_TOLERANCE = 0.05   # the same config on the same stdlib: a real drift is larger
TIME_RATIO_LIMIT = 1.5


def machine() -> str:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    import torch
    return (f"{cpus} CPUs ({platform.processor() or platform.machine()}), Python "
            f"{platform.python_version()}, torch {torch.__version__}")


def measure() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.monotonic()
        proc = subprocess.run([sys.executable, str(ROOT / "entrypoint.py"), "train",
                               str(ROOT / "configs" / "quickstart.yaml"), f"output.dir={tmp}",
                               "logging.progress=plain"], capture_output=True, text=True)
        wall = time.monotonic() - start
        if proc.returncode != 0:
            sys.exit(f"quickstart failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        run = Path(tmp) / "quickstart"
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        result = json.loads((run / "result.json").read_text())
    train = [r for r in rows if "loss" in r]
    return {"machine": machine(), "wall_s": round(wall, 1),
            "step_time_ms": round(1000 * statistics.median(r["step_time_s"] for r in train
                                                           if r["step"] > 10), 1),
            "steps": train[-1]["step"], "first_loss": round(train[0]["loss"], 3),
            "first_step": train[0]["step"], "final_loss": round(train[-1]["loss"], 3),
            "val_loss": round(result["val/loss"], 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", action="store_true", help="rewrite bench/quickstart.json")
    args = parser.parse_args()
    now = measure()
    if args.record:
        RECORD.write_text(json.dumps({**now, "date": time.strftime("%Y-%m-%d")}, indent=2) + "\n")
        print(json.dumps(now, indent=2))
        return 0
    ref = json.loads(RECORD.read_text())
    print(f"now:      {now['machine']}\nrecorded: {ref['machine']} ({ref['date']})")
    print(f"{'':14}{'now':>10}{'recorded':>10}{'ratio':>8}")
    drift = []
    for key in ("wall_s", "step_time_ms", "first_loss", "final_loss", "val_loss"):
        ratio = now[key] / ref[key]
        print(f"{key:14}{now[key]:>10}{ref[key]:>10}{ratio:>8.2f}")
        if key.endswith("loss") and abs(now[key] - ref[key]) > LOSS_TOLERANCE:
            drift.append(f"{key} {now[key]} vs {ref[key]}")
    ratio = now["wall_s"] / ref["wall_s"]
    if not 1 / TIME_RATIO_LIMIT <= ratio <= TIME_RATIO_LIMIT:
        drift.append(f"wall time x{ratio:.2f} (another machine, or a loaded one, also shows here)")
    for line in drift:
        print(f"DRIFT: {line}")
    return 1 if drift else 0


if __name__ == "__main__":
    sys.exit(main())
