"""Rank-0 metrics: console (live bar on a terminal, plain lines otherwise), metrics.jsonl,
TensorBoard and the optional trackers (train/observe/trackers.py: MLflow, W&B).

After a resume at step s, rows and events from step s on are dropped before new ones
are written (metrics.jsonl rewritten, TensorBoard's ``purge_step``), so every step
appears once: the rerun's values.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from train.core.config import Config, to_yaml
from train.core.files import json_text, open_append, write_atomic
from train.core.run import rundir
from train.core.run.identity import COMMAND_VAR
from train.guards.shutdown import Shutdown
from train.observe.board import Board
from train.observe.console import Console, format_duration
from train.observe.trackers import Trackers

if TYPE_CHECKING:
    import torch

    from train.observe.slowlinks import LinkFinding
    from train.observe.stragglers import Finding

log = logging.getLogger("train")
SLOWEST_RANK = "ranks/slowest_ratio"
FILES_ONLY = "data/"  # the data's wait and bytes fetched: files and trackers, not the console


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


class MetricsLogger:
    """Writes every sink; created on rank 0 only."""

    def __init__(self, cfg: Config, run_dir: Path, start_step: int, *, throughput_unit: str,
                 shutdown: Shutdown | None = None):
        """``shutdown``: the run's end, whose deadline bounds the trackers' close."""
        self.shutdown = shutdown or Shutdown(cfg.train.shutdown_timeout_s)
        self.cfg, self.max_steps, self.unit = cfg, cfg.train.max_steps, throughput_unit
        self.jsonl_path = run_dir / rundir.METRICS
        truncate_jsonl(self.jsonl_path, start_step)
        self.jsonl = open_append(self.jsonl_path)
        style = cfg.logging.progress
        self.console = Console(self.max_steps, throughput_unit,
                               bar=style == "bar" or (style == "auto" and sys.stdout.isatty()))
        self.per_step = self.console.bar  # step() after every step: only a bar moves
        self.run_dir, self.started = run_dir, time.monotonic()
        self.tb = Board(run_dir / rundir.BOARD, start_step, to_yaml(cfg)) \
            if cfg.logging.tensorboard else None
        self.hparams = _flat_hparams(cfg)
        self.trackers = Trackers(cfg, run_dir, self.hparams)
        self.trackers.artifact(run_dir / rundir.CONFIG)  # this attempt's resolved config
        self.closed = False
        self.writes_text = cfg.model.kind == "gpt" and cfg.data.kind == "text"  # bytes

    def log(self, step: int, values: dict[str, float], *, step_time: float,
            ranks: float | None = None) -> None:
        """``ranks``: the slowest rank's phase time over the others' median (stragglers),
        in the files and trackers, not on the console."""
        recorded = {**values, "step_time_s": step_time}
        if ranks is not None:
            recorded[SLOWEST_RANK] = ranks
        row = {"step": step, **recorded, "time": time.time()}
        self.jsonl.write(json_text(row) + "\n")
        if self.tb:
            self.tb.log_train(step, recorded)
        self.trackers.log(step, recorded)
        self.console.row(step, {k: v for k, v in values.items() if not k.startswith(FILES_ONLY)},
                         step_time)

    def named(self, finding: Finding | LinkFinding) -> None:
        """A rank or a node's link named slow (or keeping pace again): the console,
        metrics.jsonl and TensorBoard's text tab."""
        self.console.end_line()
        log.warning("%s", finding.line())
        self.jsonl.write(json_text({**finding.record(), "time": time.time()}) + "\n")
        if self.tb:
            self.tb.note(finding.step, finding.TAG, finding.line())

    def step(self, step: int) -> None:
        """After a step, when ``per_step`` (a bar): moves it and feeds its ETA (no device
        sync). Plain lines take their ETA at each logging step instead."""
        self.console.step(step)

    def log_eval(self, step: int, values: dict[str, float]) -> None:
        self.jsonl.write(json_text({"step": step, **values}) + "\n")
        if self.tb:
            self.tb.log_val(step, values)
        self.trackers.log(step, values)
        self.console.eval(step, values)

    def summary(self, step: int, final: dict[str, float]) -> None:
        """The closing lines of a finished run: result, time, where it is, what next."""
        def shown(path: Path) -> str:
            try:
                return str(path.resolve().relative_to(Path.cwd()))
            except ValueError:
                return str(path)
        loss = self.console.values.get("loss")
        result = [f"step {step}/{self.max_steps}"]
        result += [f"loss {loss:.4g}"] if loss is not None else []
        result += [f"{k} {v:.4g}" for k, v in final.items()]
        run = shown(self.run_dir)
        command = os.environ.get(COMMAND_VAR, "entrypoint.py")
        lines = [f"done: {' | '.join(result)} | {format_duration(time.monotonic() - self.started)}"
                 " in this process",
                 f"  run directory  {run}  (metrics.jsonl, result.json, checkpoints/)",
                 f"  export         {command} export {run}",
                 *([f"  generate       {command} generate {run} --prompt 'def '  (after export)"]
                   if self.writes_text else []),
                 f"  TensorBoard    tensorboard --logdir {shown(self.run_dir.parent)}"
                 if self.tb else "  TensorBoard    off (logging.tensorboard=false)",
                 *self.trackers.lines()]
        self.console.end_line()
        sys.stdout.write("\n".join(lines) + "\n")
        sys.stdout.flush()

    def close(self, final: dict[str, float] | None = None, status: str = "FINISHED") -> None:
        """``final``: the finished run's last evaluation; ``status``: the trackers' word
        for how this attempt ended (FINISHED, FAILED or KILLED). Once only."""
        if self.closed:
            return
        self.closed = True
        if self.tb:
            # finished: HParams row (metrics: the final evaluation's, else the train loss)
            self.tb.close(self.hparams if final is not None else None, metrics=list(final or {}))
        self.console.close()
        self.jsonl.close()
        for what in self.trackers.close(status, self.shutdown.seconds_left):  # may wait
            self.shutdown.abandon(what)


def _flat_hparams(cfg: Config) -> dict[str, Any]:
    from train.core.config import to_dict
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


def gpu_memory_stats(device: torch.device) -> dict[str, float]:
    """Peak memory of this logging interval (rank 0's GPU), then reset for the next one."""
    import torch
    if device.type != "cuda":
        return {}
    stats = {"gpu/peak_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30,
             "gpu/reserved_gb": torch.cuda.memory_reserved(device) / 2**30}
    torch.cuda.reset_peak_memory_stats(device)
    return stats
