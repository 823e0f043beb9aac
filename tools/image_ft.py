"""Replica groups inside the CPU image: the image test checks that the published image
carries torchft (its Manager and the ``torchft_lighthouse`` binary), so that
``distributed.fault_tolerance: replicas`` and the replicas kustomize component run on it
as it is.

Two runs, both as the image's non-root user: ``entrypoint.py lighthouse`` (the
component's Lighthouse Deployment) serves its dashboard on its port; a training of two
replica groups of one process each, a few steps of the quick start on CPU, writes its
run directory to the host, where every step of the ledger names both groups.
"""

from __future__ import annotations

import json
from pathlib import Path

from tools.oci import Engine, Failed, log
from train.core.run import rundir

STEPS = 4
TRAIN = ("distributed.fault_tolerance=replicas", "distributed.replicas=2",
         f"train.max_steps={STEPS}", "schedule.warmup_steps=2",
         f"train.eval_every_steps={STEPS}", f"checkpoint.every_steps={STEPS}",
         "logging.every_steps=2", "run.name=replicas")
# The Lighthouse as the kustomize component runs it, asked for its dashboard, stopped.
LIGHTHOUSE = """set -e
python3 /app/entrypoint.py lighthouse --port 29510 & pid=$!
python3 - <<'EOF'
import time, urllib.request
for _ in range(100):
    try:
        page = urllib.request.urlopen("http://127.0.0.1:29510/", timeout=2).read()
        break
    except OSError:
        time.sleep(0.2)
else:
    raise SystemExit("the Lighthouse did not answer on port 29510 within 20 s")
assert b"Lighthouse" in page, page[:200]
print("entrypoint.py lighthouse serves on port 29510")
EOF
kill "$pid"; wait "$pid" || true
"""


def check_replica_ledger(run_dir: Path, steps: int, groups: int) -> str:
    """Every step 1..steps trained once, by all ``groups`` replica groups; the run
    finished (result.json at the last step)."""
    ledger = run_dir / rundir.LEDGER
    if not ledger.is_file():
        raise Failed(f"{ledger} missing: the replica run kept no ledger")
    rows = [json.loads(ln) for ln in ledger.read_text().splitlines() if ln.strip()]
    if [r["step"] for r in rows] != list(range(1, steps + 1)):
        raise Failed(f"{ledger}: steps {[r['step'] for r in rows]}, expected 1..{steps}")
    short = [r["step"] for r in rows if sorted(r["replicas"]) != list(range(groups))]
    if short:
        raise Failed(f"{ledger}: steps {short} trained without all {groups} replica groups")
    result = run_dir / rundir.RESULT
    if not result.is_file() or json.loads(result.read_text()).get("step") != steps:
        raise Failed(f"{result} missing or not at step {steps}")
    if not (run_dir / rundir.LOGS / "lighthouse.log").is_file():
        raise Failed(f"{run_dir / rundir.LOGS}/lighthouse.log missing")
    return f"replicas: {steps} steps, each by all {groups} replica groups (ledger.jsonl)"


def replica_run(engine: Engine, img: str, runs: Path) -> None:
    log("torchft in the image: entrypoint.py lighthouse serves (the replicas component)")
    engine.run("--entrypoint", "bash", img, "-c", LIGHTHOUSE)
    log("train: 2 replica groups (distributed.fault_tolerance=replicas), torchft's Lighthouse")
    engine.run("-v", f"{runs}:/workspace/runs", "--shm-size=1g", img, "train",
               "configs/quickstart.yaml", *TRAIN)
    print(check_replica_ledger(runs / "replicas", STEPS, 2))
