"""Throughput we can state: tokens/s, MFU and peak memory of configs/gpt-small.yaml in
the trainer and in a plain loop (bench/plain_ddp.py), on one device and on all local
GPUs, measured in one run.

MFU (model FLOPs utilisation) = tokens/s x model FLOPs per token / the peak FLOP/s of
the devices used. Model FLOPs per token follow the PaLM paper's appendix B: 6 for each
parameter a matmul uses (forward 2, backward 4: the position embedding is a lookup, the
tied head a matmul) plus 12 x depth x width x context for attention's two matmuls over
the context (no discount for the causal mask). The peak is the vendor's dense bf16
tensor figure for the GPU torch names (PEAKS_TFLOPS), or, on a CPU, measured here: the
best of a few fp32 matmuls on the threads the run gets. On a CPU the model is shrunk
(CPU_SHAPE) so the bench runs in a minute; its MFU is against that measured peak.

    python -m bench.throughput [--steps 40] [--warmup 10] [overrides...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.measure import measured
from train.core.config import load_config

ROOT = Path(__file__).resolve().parent.parent

CONFIG = ROOT / "configs" / "gpt-small.yaml"
CPU_SHAPE = ("device=cpu", "precision=fp32", "model.depth=2", "model.width=128",
             "model.heads=4", "model.context_length=128", "train.global_batch_size=8",
             "data.max_bytes=2000000", "data.num_workers=0")
# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity), from the vendors' data sheets;
# the first key found in torch's device name wins (longest keys first).
PEAKS_TFLOPS = {
    "B200": 2250, "H200": 989, "H100 PCIe": 756, "H100": 989, "H800": 989, "GH200": 989,
    "A100": 312, "A800": 312, "L40S": 362, "L40": 181, "L4": 121, "A10G": 70, "A10": 125,
    "RTX 6000 Ada": 364, "RTX A6000": 155, "V100": 125, "T4": 65,
    "MI355X": 2500, "MI325X": 1307, "MI300X": 1307, "MI300A": 980, "MI250X": 383,
    "MI250": 362, "MI210": 181,
}


def gpu_peak_flops(name: str) -> float | None:
    for key in sorted(PEAKS_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAKS_TFLOPS[key] * 1e12
    return None


def cpu_peak_flops(threads: int, size: int = 1024, tries: int = 5) -> float:
    """The best fp32 matmul rate of ``tries`` on ``threads`` threads."""
    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up
    best = min(_timed(lambda: a @ b) for _ in range(tries))
    return 2 * size ** 3 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def flops_per_token(model_cfg, parameters: int) -> float:
    """6 per matmul parameter + attention over the context (see the module docstring)."""
    d, depth, t = model_cfg.width, model_cfg.depth, model_cfg.context_length
    return 6 * (parameters - t * d) + 12 * depth * d * t


def parameter_count(cfg) -> int:
    from train.data.builders import build_data
    from train.models import build_model
    data = build_data(cfg)
    model = build_model(cfg.model, input_shape=data.input_shape, num_classes=data.num_classes)
    return sum(p.numel() for p in model.parameters())


def plain(config: Path, nproc: int, warmup: int, overrides: list[str],
          env: dict[str, str]) -> tuple[float, int]:
    run = measured([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={nproc}", str(ROOT / "bench/plain_ddp.py"), str(config),
                    str(warmup), *overrides], env, ROOT)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    return result["step_time_s"], result["gpu_peak_bytes"] or run.max_rss_bytes


def trainer(config: Path, nproc: int, warmup: int, overrides: list[str], env: dict[str, str],
            name: str) -> tuple[float, int]:
    rss = measured([sys.executable, str(ROOT / "entrypoint.py"), "train", str(config),
                    *overrides, f"distributed.nproc_per_node={nproc}", f"run.name={name}"],
                   env, ROOT).max_rss_bytes
    rows = [json.loads(line) for line in (config.parent / "runs" / name / "metrics.jsonl")
            .read_text().splitlines()]
    timed = [r["step_time_s"] for r in rows if "step_time_s" in r and r["step"] > warmup]
    peaks = [r["gpu/peak_allocated_gb"] for r in rows if "gpu/peak_allocated_gb" in r]
    return statistics.fmean(timed), int(max(peaks) * 2**30) if peaks else rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("overrides", nargs="*", help="dotted.key=value for the config")
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    shape = [] if gpus else list(CPU_SHAPE)
    overrides = [*shape, f"train.max_steps={args.steps}", "train.eval_every_steps=0",
                 "checkpoint.every_steps=0", "logging.every_steps=5", "logging.progress=plain",
                 "checkpoint.resume_from=none", *args.overrides]
    cfg = load_config(CONFIG, overrides)
    threads = max(1, min(os.cpu_count() or 1, len(os.sched_getaffinity(0))))
    if gpus:
        name = torch.cuda.get_device_name(0)
        peak, device = gpu_peak_flops(name), f"{gpus} x {name}"
    else:
        peak, device = cpu_peak_flops(threads), f"CPU, {threads} threads"
    per_token = flops_per_token(cfg.model, parameter_count(cfg))
    tokens = cfg.train.global_batch_size * cfg.model.context_length
    print(f"device: {device}; torch {torch.__version__}; peak "
          f"{'unknown (not in PEAKS_TFLOPS)' if peak is None else f'{peak / 1e12:.2f} TFLOP/s'}"
          f"{' (measured fp32 matmul)' if not gpus else ' (bf16, data sheet)'}")
    print(f"model: {cfg.model.depth} x {cfg.model.width}, context {cfg.model.context_length}; "
          f"{per_token / 1e6:.1f} MFLOP per token; {tokens} tokens per step; "
          f"precision {cfg.precision}, compile {cfg.compile}")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads))
    sizes = [1] + ([gpus] if gpus > 1 else [])
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "bench.yaml"
        config.write_text(CONFIG.read_text())
        overrides.append(f"output.dir={Path(tmp) / 'runs'}")
        print(f"{'run':<22}{'tokens/s':>12}{'MFU':>8}{'peak memory':>14}{'speed vs plain':>16}")
        for n in sizes:
            results = {"plain loop": plain(config, n, args.warmup, overrides, env),
                       "trainer": trainer(config, n, args.warmup, overrides, env, f"t{n}")}
            base = results["plain loop"][0]
            for label, (step_s, memory) in results.items():
                rate = tokens / step_s
                mfu = f"{rate * per_token / (peak * n):.1%}" if peak else "?"
                print(f"{label + f' x{n}':<22}{rate:>12,.0f}{mfu:>8}"
                      f"{memory / 2**20:>11,.0f} MiB{base / step_s:>16.3f}", flush=True)


if __name__ == "__main__":
    main()
