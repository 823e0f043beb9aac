"""The GPU check: every GPU path of the project, run for real on a GPU machine.

``scripts/gpu-check`` runs ``python -m tools.gpu_check`` from the repository root
(``PYTHON`` picks the interpreter, ``OUT`` the output folder). Stages, each with its own
time limit (about 7 minutes in all without ``GPU_CHECK_SUITE``):

======== =====================================================================
deps     python, torch build, the packages the launcher and worker import
doctor   ``entrypoint.py doctor --json`` (detection, driver vs build, plan)
comm     ``doctor --comm`` (the preflight check: matmul on each GPU, all-reduce, nccl)
train    quickstart, bf16, one GPU, nccl, 60 steps
ddp      the same on every local GPU (two or more): DDP over nccl with the single-node
         plan's defaults (store and process group on loopback, NCCL_SOCKET_IFNAME=lo)
stop     the same run, SIGTERM after a few steps: exit 143 with a checkpoint
tests    the suite's GPU-marked tests (``pytest -m gpu``)
suite    ``GPU_CHECK_SUITE=1`` only: tests/static and tests/unit but the image tests
savers   fp16 + GradScaler, activation checkpointing, micro_batch_size=auto
fsdp     FSDP2 on one GPU with CPU offload and bf16 params (sharded checkpoints)
dcp      the fsdp run resumed from its sharded checkpoint, saving in the background
dp       DataParallel with bf16 (autocast inside the replicas' forward)
replicas 2 replica groups (torchft), one GPU each, DDP; ``replicas_fsdp``: FSDP in each
compile  torch.compile on the GPU (inductor + triton), 30 steps
speed    ``python -m bench.throughput``: gpt-small's tokens/s, MFU and peak memory in the
         trainer and in a plain loop, one GPU and all local GPUs (the figures docs
         and issue notes quote)
======== =====================================================================

Results land in ``OUT`` as each stage ends (:mod:`tools.stages`): ``summary.txt``,
``stages.jsonl``, ``logs.txt``, plus ``doctor.json`` and ``train-metrics.jsonl``.
Exit 0 all passed, 1 a stage failed, 3 no GPU here (GPU stages skipped).
``GPU_CHECK_FORCE_CPU=1`` runs every stage on the CPU (gloo, fp32) to test the check
itself on a machine without a GPU; ``GPU_CHECK_ONLY=a,b`` runs only those stages
(deps and doctor always run).

Standard library only: a bare GPU machine's Python may lack the project's packages
(they are borrowed from a carried ``.venv`` when present, see :func:`borrow_packages`).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tools.stages import Recorder, Result, run_limited, stop_group
from train.core.run import rundir

ROOT = Path(__file__).resolve().parent.parent
# Pure-Python packages a bare GPU machine may lack, taken from a carried .venv.
BORROWED = ("yaml", "pynvml", "pytest", "_pytest", "pluggy", "iniconfig", "packaging", "py")


@dataclass
class Context:
    """What every stage reads: where things are and how this machine is checked."""
    python: str
    out: Path
    work: Path
    force_cpu: bool = False
    tensorboard: bool = True
    gpus: int = 0
    env: dict[str, str] = field(default_factory=dict)

    @property
    def device(self) -> list[str]:
        return ["device=cpu", "distributed.backend=gloo"] if self.force_cpu \
            else ["device=gpu", "distributed.backend=nccl"]

    @property
    def precision(self) -> str:  # bf16 matmuls are emulated (seconds a step) on most CPUs
        return "fp32" if self.force_cpu else "bf16"

    def entry(self, *args: str) -> list[str]:
        return [self.python, str(ROOT / "entrypoint.py"), *args]

    def train(self, name: str, *overrides: str) -> list[str]:
        return self.entry("train", str(ROOT / "configs/quickstart.yaml"), *self.device,
                          f"precision={self.precision}", "distributed.nproc_per_node=1",
                          f"output.dir={self.work / 'runs'}", "logging.progress=plain",
                          f"logging.tensorboard={str(self.tensorboard).lower()}",
                          "data.max_bytes=1000000", "train.eval_batches=2", f"run.name={name}",
                          *overrides)

    def metrics(self, run: str) -> Path:
        return self.work / "runs" / run / rundir.METRICS


# ------------------------------------------------------------------ notes

def deps_note(output: str) -> str:
    head = next((ln for ln in output.splitlines() if ln.startswith("python")), "")
    missing = next((ln for ln in output.splitlines() if ln.startswith("MISSING=") and
                    ln != "MISSING="), "")
    return head + (f"; {missing}" if missing else "")


def doctor_summary(output: str) -> tuple[int | None, str]:
    """(GPUs found, or None when doctor gave no JSON; a one-line note)."""
    try:
        report = json.loads(output[output.index("{"):])
    except ValueError as exc:
        return None, f"doctor gave no JSON ({exc})"
    hw, plan = report["hardware"], report.get("plan") or {}
    fails = [f["message"] for f in report["findings"] if f["level"] == "fail"]
    if not hw["gpus"]:
        why = "; ".join(hw.get("warnings", []) + hw.get("notes", [])) or "nothing found"
        return 0, f"no GPU: {why}"
    g = hw["gpus"][0]
    mem = f"{g['memory_bytes'] / 2**30:.1f} GiB" if g.get("memory_bytes") else "?"
    return len(hw["gpus"]), (
        f"{len(hw['gpus'])} GPU(s) via {hw['source']}: {g['name']} {g.get('arch')} {mem}, "
        f"driver {hw.get('driver_version')} (CUDA {hw.get('cuda_driver_version')}); plan "
        f"{plan.get('device')}/{plan.get('backend')} x{plan.get('nproc_per_node')}"
        + (f"; FAIL: {fails[0]}" if fails else ""))


def loss_note(metrics: Path, unit: str = "") -> str:
    """``N steps: loss A -> B`` (+ throughput or peak memory) from a run's metrics.jsonl."""
    try:
        rows = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]
        losses = [r for r in rows if "loss" in r]
        first, last = losses[0], losses[-1]
    except (OSError, ValueError, IndexError):
        return "no metrics written"
    finite = all(math.isfinite(r["loss"]) for r in losses)
    extra = f", {last.get('throughput', 0):,.0f} {unit}/s" if unit else ""
    if "gpu/peak_allocated_gb" in last:
        extra += f", peak {last['gpu/peak_allocated_gb']:.2f} GiB"
    return (f"{last['step']} steps: loss {first['loss']:.3f} -> {last['loss']:.3f}"
            f"{'' if finite else ' NOT FINITE'}{extra}")


def pytest_note(output: str) -> str:
    lines = [ln for ln in output.splitlines()
             if re.search(r"^\d+ (passed|failed)|(passed|failed|skipped|error).* in [\d.]+s", ln)]
    return lines[-1].strip("= ") if lines else "no pytest summary"


def throughput_note(output: str) -> str:
    """bench/throughput.py's table, one row per run: tokens/s, MFU, memory, vs plain."""
    device = first_match(r"(?<=^device: )[^;]*", output)
    rows = [" ".join(line.split()) for line in output.splitlines()
            if re.match(r"^(plain loop|trainer) x\d+ ", line)]
    return f"{device}: " + "; ".join(rows) if rows else "no throughput table"


def first_match(pattern: str, output: str) -> str:
    m = re.search(pattern, output, re.M)
    return m.group(0) if m else ""


# ------------------------------------------------------------------ stages

DEPS = r"""
import importlib, sys
import torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda",
      torch.version.cuda, "| hip", getattr(torch.version, "hip", None))
missing = []
for mod in ("yaml", "numpy", "pynvml", "tensorboard"):
    try:
        importlib.import_module(mod)
    except Exception as exc:
        missing.append(mod)
        print("missing", mod, exc)
print("MISSING=" + ",".join(missing))
sys.exit(1 if {"yaml", "numpy"} & set(missing) else 0)
"""


@dataclass(frozen=True)
class Stage:
    """One GPU stage: its command, limit, the exit code that means success and its note."""
    name: str
    limit_s: float
    argv: Callable[[Context], list[str]]
    note: Callable[[Context, str], str]
    expect: Callable[[Context], int] = lambda ctx: 0
    when: Callable[[Context], bool] = lambda ctx: True
    must_say: str | None = None  # a pattern its output must show to pass


RESUMED = r"resumed from .*? at step \d+"

AUTO_BATCH = r"micro_batch_size=auto: \d+ fits"  # what the worker logs when it chose


def _savers_batch(ctx: Context) -> list[str]:
    # big enough that micro_batch_size=auto has a choice; fp16 matmuls are slow on a CPU
    batch, steps = (16, 8) if ctx.force_cpu else (256, 30)
    return [f"train.max_steps={steps}", f"train.global_batch_size={batch}"]


def _ranks(ctx: Context) -> int:
    return 2 if ctx.force_cpu else ctx.gpus


def _has_torchft(ctx: Context) -> bool:
    return (Path(ctx.python).parent / "torchft_lighthouse").exists()


def _offload(ctx: Context) -> list[str]:
    return [] if ctx.force_cpu else ["memory.cpu_offload=true"]  # needs an accelerator


GPU_STAGES: tuple[Stage, ...] = (
    Stage("comm", 90, lambda c: c.entry("doctor", "--comm", "--comm-timeout", "45"),
          lambda c, out: " ".join([first_match(r"(?<=^comm ).*", out).strip(),
                                   first_match(r"preflight: .*", out),
                                   first_match(r"^FAIL.*rank.*", out)]).strip()),
    Stage("train", 100, lambda c: c.train("bf16", "train.max_steps=60",
                                          "checkpoint.every_steps=0"),
          lambda c, out: f"{c.precision} " + loss_note(c.metrics("bf16"), "tokens")),
    # one process per local GPU through the single-node plan (nothing listens beyond
    # loopback): NCCL's bootstrap must work on lo; on the CPU, two gloo processes
    Stage("ddp", 120, lambda c: c.train("ddp", f"distributed.nproc_per_node={_ranks(c)}",
                                        "checkpoint.every_steps=0",
                                        f"train.max_steps={6 if c.force_cpu else 30}"),
          lambda c, out: f"{_ranks(c)} processes: {loss_note(c.metrics('ddp'))}",
          when=lambda c: _ranks(c) >= 2, must_say=r"world size [2-9]|world size \d\d"),
    # replica groups on GPUs: each group its own devices (never a shared one), torchft's
    # NCCL process group across them; where torchft is installed beside the Python
    Stage("replicas", 120, lambda c: c.train("replicas", "distributed.fault_tolerance=replicas",
                                             "distributed.replicas=2", "train.max_steps=30",
                                             "checkpoint.every_steps=10"),
          lambda c, out: f"2 replica groups: {loss_note(c.metrics('replicas'))}",
          when=lambda c: _ranks(c) >= 2 and _has_torchft(c),
          must_say=r"in each of 2 replica groups"),
    # the same with FSDP in each group (one process a group: its shards are whole tensors;
    # the shard sums and heals of groups of several processes: tests/e2e, on the CPU)
    Stage("replicas_fsdp", 120, lambda c: c.train("replicas_fsdp",
                                                  "distributed.fault_tolerance=replicas",
                                                  "distributed.replicas=2",
                                                  "distributed.strategy=fsdp",
                                                  "train.max_steps=30",
                                                  "checkpoint.every_steps=10"),
          lambda c, out: f"2 fsdp replica groups: {loss_note(c.metrics('replicas_fsdp'))}",
          when=lambda c: _ranks(c) >= 2 and _has_torchft(c),
          must_say=r"in each of 2 replica groups"),
    Stage("tests", 240, lambda c: [c.python, "-m", "pytest", "-q", "-m", "gpu", "-p",
                                   "no:cacheprovider", str(ROOT / "tests")],
          lambda c, out: f"gpu-marked tests: {pytest_note(out)}"),
    Stage("suite", 540, lambda c: [c.python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                   f"--ignore={ROOT / 'tests/static/test_images_static.py'}",
                                   str(ROOT / "tests/static"), str(ROOT / "tests/unit")],
          lambda c, out: f"static and unit tiers without the image tests: {pytest_note(out)}",
          when=lambda c: c.env.get("GPU_CHECK_SUITE") == "1"),
    Stage("savers", 90, lambda c: c.train("savers", "precision=fp16", "schedule.warmup_steps=2",
                                          "train.micro_batch_size=auto",
                                          "memory.activation_checkpointing=full",
                                          *_savers_batch(c)),
          lambda c, out: f"{first_match(AUTO_BATCH, out)}; {loss_note(c.metrics('savers'))}"),
    Stage("fsdp", 90, lambda c: c.train("fsdp", "distributed.strategy=fsdp", *_offload(c),
                                        "train.max_steps=30"),
          lambda c, out: f"fsdp {' '.join(_offload(c)) or 'no offload'}: "
                         f"{loss_note(c.metrics('fsdp'))}"),
    # DCP on the GPU: the sharded step-30 checkpoint loads onto the device (nccl), and the
    # background saves stage GPU shards to CPU and write them over their own gloo group
    Stage("dcp", 90, lambda c: c.train("fsdp", "distributed.strategy=fsdp", *_offload(c),
                                       "train.max_steps=45", "checkpoint.every_steps=5",
                                       "checkpoint.async_save=true"),
          lambda c, out: f"{first_match(RESUMED, out) or 'did not resume'}; "
                         f"{first_match(r'checkpoint saved: .*', out)}",
          must_say=RESUMED),
    # dp with device=cpu is a contradiction: exit 2 is its right answer on a CPU
    Stage("dp", 90, lambda c: c.train("dp", "distributed.strategy=dp", "train.max_steps=20"),
          lambda c, out: f"dp bf16 (autocast inside forward): {loss_note(c.metrics('dp'))}",
          expect=lambda c: 2 if c.force_cpu else 0),
    Stage("compile", 120, lambda c: c.train("compile", "compile=true", "train.max_steps=30"),
          lambda c, out: f"compile=true: {loss_note(c.metrics('compile'))}"),
    # last: the longest, and the others' answers matter more on a short loan
    Stage("speed", 300, lambda c: [c.python, "-m", "bench.throughput",  # ROOT on PYTHONPATH
                                   *(["--steps", "6", "--warmup", "2"] if c.force_cpu
                                     else ["--steps", "40", "--warmup", "10"])],
          lambda c, out: throughput_note(out), must_say=r"trainer x1 "),
)


def run_stage(rec: Recorder, ctx: Context, stage: Stage) -> str:
    t0 = time.monotonic()
    argv = stage.argv(ctx)
    rc, out = run_limited(argv, stage.limit_s, cwd=ctx.work, env=ctx.env)
    rec.log(f"{stage.name} (limit {stage.limit_s:.0f}s): {' '.join(argv)}", out)
    ok = rc == stage.expect(ctx) and (stage.must_say is None or
                                     re.search(stage.must_say, out) is not None)
    rec.record(Result(stage.name, rc, time.monotonic() - t0, ok, stage.note(ctx, out)))
    return out


def stop_stage(rec: Recorder, ctx: Context, limit_s: float = 60) -> None:
    """SIGTERM after step 5 of a long run: it must checkpoint and exit 143."""
    t0 = time.monotonic()
    log = ctx.work / "stop-run.log"
    argv = ctx.train("stop", "train.max_steps=100000", "logging.every_steps=1")
    with log.open("w") as f:
        proc = subprocess.Popen(argv, cwd=ctx.work, env=ctx.env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and proc.poll() is None and \
            "step 5/" not in log.read_text(errors="replace"):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        stop_group(proc)
        rc = 124
    latest = ctx.work / "runs/stop/checkpoints/latest"
    checkpoint = latest.read_text().strip() if latest.exists() else "missing"
    rec.log(f"stop (limit {limit_s:.0f}s): {' '.join(argv)}", log.read_text(errors="replace"))
    rec.record(Result("stop", rc, time.monotonic() - t0, rc == 143,
                      f"exit {rc} (want 143); checkpoint {checkpoint}"))


def borrow_packages(python: str, shim: Path) -> list[str]:
    """Link the packages ``python`` cannot import from a carried .venv into ``shim``."""
    shim.mkdir(parents=True, exist_ok=True)
    linked = []
    for mod in BORROWED:
        if subprocess.run([python, "-c", f"import {mod}"], capture_output=True).returncode == 0:
            continue
        found = sorted(ROOT.glob(f".venv/lib/python3*/site-packages/{mod}")) + \
            sorted(ROOT.glob(f".venv/lib/python3*/site-packages/{mod}.py"))
        if found:
            (shim / found[0].name).symlink_to(found[0])
            linked.append(mod)
    return linked


def check(ctx: Context, rec: Recorder, only: set[str] | None = None) -> int:
    """Every stage in order; the exit code of the whole check."""
    t0 = time.monotonic()
    rc, out = run_limited([ctx.python, "-c", DEPS], 60, cwd=ctx.work, env=ctx.env)
    rec.log("deps (limit 60s)", out)
    rec.record(Result("deps", rc, time.monotonic() - t0, rc == 0, deps_note(out)))
    ctx.tensorboard = not re.search(r"^MISSING=.*tensorboard", out, re.M)
    doctor = run_stage(rec, ctx, Stage("doctor", 60, lambda c: c.entry("doctor", "--json"),
                                       lambda c, out: doctor_summary(out)[1]))
    (ctx.out / "doctor.json").write_text(doctor[doctor.find("{"):] if "{" in doctor else "")
    gpus, _ = doctor_summary(doctor)
    if gpus is None:
        return 1
    if gpus == 0 and not ctx.force_cpu:
        rec.record(Result("gpu-stages", 0, 0, False, "skipped: no GPU here", skipped=True))
        return 3
    ctx.gpus = gpus
    for stage in GPU_STAGES:
        if stage.name == "tests" and (only is None or "stop" in only):
            stop_stage(rec, ctx)
        if stage.when(ctx) and (only is None or stage.name in only):
            run_stage(rec, ctx, stage)
    metrics = ctx.metrics("bf16")
    if metrics.exists():
        (ctx.out / "train-metrics.jsonl").write_bytes(metrics.read_bytes())
    return 1 if rec.failed else 0


def main() -> int:
    python = sys.executable  # scripts/gpu-check runs this module with $PYTHON
    out = Path(os.environ.get("OUT") or ROOT / "gpu-check-out")
    only = set(filter(None, os.environ.get("GPU_CHECK_ONLY", "").split(","))) or None
    with tempfile.TemporaryDirectory(prefix="gpu-check.") as tmp:
        work = Path(tmp)
        shim = work / "pyshim"
        borrow_packages(python, shim)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(shim),
                                                          env.get("PYTHONPATH")]))
        ctx = Context(python, out, work, force_cpu=env.get("GPU_CHECK_FORCE_CPU") == "1",
                      env=env)
        rec = Recorder(out, "gpu-check")
        code = check(ctx, rec, only)
        print(rec.summary(), end="")
        if code == 3:
            print(f"gpu-check: no GPU here; GPU stages skipped (see {out}/summary.txt)",
                  file=sys.stderr)
        elif code == 1 and not any(r.name not in ("deps", "doctor") for r in rec.rows):
            print(f"gpu-check: doctor failed (see {out}/logs.txt)", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
