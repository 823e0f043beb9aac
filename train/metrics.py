"""Rank-0 metrics: console (live bar on a terminal, plain lines otherwise), metrics.jsonl
and TensorBoard.

After a resume at step s, rows and events from step s on are dropped before new ones
are written (metrics.jsonl rewritten, TensorBoard's ``purge_step``), so every step
appears once: the rerun's values.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from train.config import Config, to_yaml
from train.files import json_text, write_atomic


def truncate_jsonl(path: Path, keep_through_step: int) -> None:
    """Keep rows with step <= keep_through_step (the resumed checkpoint's step); a torn
    last line (killed mid-write) is dropped."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and row.get("step", math.inf) <= keep_through_step:
            kept.append(line)
    write_atomic(path, "".join(k + "\n" for k in kept))


def format_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}" if h else f"{rem // 60}:{rem % 60:02d}"


class MetricsLogger:
    """Writes every sink; created on rank 0 only."""

    def __init__(self, cfg: Config, run_dir: Path, start_step: int, *, throughput_unit: str):
        self.cfg, self.max_steps, self.unit = cfg, cfg.train.max_steps, throughput_unit
        self.jsonl_path = run_dir / "metrics.jsonl"
        truncate_jsonl(self.jsonl_path, start_step)
        self.jsonl = self.jsonl_path.open("a", buffering=1)
        style = cfg.logging.progress
        self.bar = style == "bar" or (style == "auto" and sys.stdout.isatty())
        self.tb = None
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=start_step + 1)
            self.tb.add_text("config", "```\n" + to_yaml(cfg) + "\n```", start_step)
        self.hparams = _flat_hparams(cfg)

    def log(self, step: int, values: dict[str, float], *, step_time: float) -> None:
        row = {"step": step, **values, "step_time_s": step_time, "time": time.time()}
        self.jsonl.write(json_text(row) + "\n")
        if self.tb:
            for key, value in values.items():
                self.tb.add_scalar(f"train/{key}" if "/" not in key else key, value, step)
            self.tb.add_scalar("perf/step_time_s", step_time, step)
        self._console(step, values, step_time)

    def _console(self, step: int, values: dict[str, float], step_time: float) -> None:
        eta = format_eta((self.max_steps - step) * step_time)
        parts = [f"step {step}/{self.max_steps}"]
        parts += [f"{k} {v:.4g}" for k, v in values.items() if k != "throughput"]
        if "throughput" in values:
            parts.append(f"{values['throughput']:.0f} {self.unit}/s")
        parts += [f"{step_time * 1000:.0f} ms/step", f"eta {eta}"]
        line = " | ".join(parts)
        if self.bar:
            done = int(30 * step / self.max_steps)
            sys.stdout.write(f"\r[{'#' * done}{'.' * (30 - done)}] {line}\x1b[K")
            if step == self.max_steps:
                sys.stdout.write("\n")
        else:
            sys.stdout.write(line + "\n")
        sys.stdout.flush()

    def log_eval(self, step: int, values: dict[str, float]) -> None:
        self.jsonl.write(json_text({"step": step, **values}) + "\n")
        if self.tb:
            for key, value in values.items():
                self.tb.add_scalar(key, value, step)
        if self.bar:
            sys.stdout.write("\n")
        sys.stdout.write(f"step {step} | " + " | ".join(f"{k} {v:.4g}" for k, v in values.items())
                         + "\n")
        sys.stdout.flush()

    def close(self, final: dict[str, float] | None = None) -> None:
        if self.tb:
            if final:
                self.tb.add_hparams(self.hparams, {f"hparam/{k}": v for k, v in final.items()},
                                    run_name=".")
            self.tb.close()
        self.jsonl.close()


def _flat_hparams(cfg: Config) -> dict[str, Any]:
    from train.config import to_dict
    out: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}{k}.", v)
        else:
            key = prefix.rstrip(".")
            out[key] = node if isinstance(node, (int, float, str, bool)) else str(node)

    walk("", to_dict(cfg))
    return out
