"""TensorBoard layout: a run opens on its loss curves.

TensorBoard draws one chart per tag and overlays the runs (directories) that share a
tag, and it orders the groups of cards (the part of a tag before ``/``) by name. So
the run writes two TensorBoard runs, ``tb/train`` and ``tb/val``, both with the tag
``loss``: one chart, train and validation together, in the first group. What follows
sorts after it: ``optim/`` (lr, grad_norm), ``perf/`` (throughput, step time, GPU
memory, the wait for data and the bytes fetched), ``score/`` (validation accuracy).
``metrics.jsonl`` keeps its own key names.

HParams: torch's ``add_hparams`` writes its metric as an extra scalar at step 0 (a
lone dot on a chart of its own) and stores booleans as numbers (its ``int`` branch
catches ``bool`` first). Here the HParams summaries are built from TensorBoard's own
protocol buffers: booleans stay booleans, the columns come in the order given (model,
optimizer, batch first), and the metric is the validation run's existing ``loss``
series, whose last point is the final validation loss.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

# (metrics.jsonl key, TensorBoard tag) for the training run; a key not listed keeps its name.
TRAIN_TAGS = {"loss": "loss", "lr": "optim/lr", "grad_norm": "optim/grad_norm",
              "throughput": "perf/throughput", "step_time_s": "perf/step_time_s",
              "gpu/peak_allocated_gb": "perf/gpu_peak_allocated_gb",
              "gpu/reserved_gb": "perf/gpu_reserved_gb", "data/wait_s": "perf/data_wait_s",
              "data/fetched_bytes": "perf/data_fetched_bytes"}
VAL_TAGS = {"val/loss": "loss", "val/accuracy": "score/accuracy"}
# HParams columns: what tells runs apart first, then everything else in config order.
HPARAM_ORDER = ("model.", "optim.", "train.global_batch_size", "train.micro_batch_size",
                "train.max_steps", "schedule.", "precision", "seed")
# The HParams plugin's names (tensorboard.plugins.hparams.metadata, whose import loads
# TensorBoard's TensorFlow stub: 0.4 s at every run's end for five constants).
HPARAMS_PLUGIN, HPARAMS_VERSION, HPARAMS_TAG = "hparams", 0, "_hparams_/"


def tag(key: str, tags: dict[str, str]) -> str:
    return tags.get(key, key)


def ordered_hparams(flat: dict[str, Any]) -> dict[str, Any]:
    """``flat`` (dotted config keys) with the keys of HPARAM_ORDER first, in that order."""
    def rank(key: str) -> int:
        for i, prefix in enumerate(HPARAM_ORDER):
            if key == prefix or (prefix.endswith(".") and key.startswith(prefix)):
                return i
        return len(HPARAM_ORDER)
    return dict(sorted(flat.items(), key=lambda kv: rank(kv[0])))  # stable: config order kept


def hparams_summaries(hparams: dict[str, Any], metric_tags: list[str]) -> list:
    """The experiment, session-start and session-end summaries of one finished run."""
    from google.protobuf import struct_pb2
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

    infos, start = [], plugin_data_pb2.SessionStartInfo(start_time_secs=time.time())
    for name, value in hparams.items():
        if isinstance(value, bool):  # before int: bool is an int
            start.hparams[name].CopyFrom(struct_pb2.Value(bool_value=value))
            kind = api_pb2.DATA_TYPE_BOOL
        elif isinstance(value, (int, float)):
            start.hparams[name].CopyFrom(struct_pb2.Value(number_value=float(value)))
            kind = api_pb2.DATA_TYPE_FLOAT64
        else:
            start.hparams[name].CopyFrom(struct_pb2.Value(string_value=str(value)))
            kind = api_pb2.DATA_TYPE_STRING
        infos.append(api_pb2.HParamInfo(name=name, type=kind))
    experiment = api_pb2.Experiment(
        hparam_infos=infos,
        metric_infos=[api_pb2.MetricInfo(name=api_pb2.MetricName(tag=t)) for t in metric_tags])
    end = plugin_data_pb2.SessionEndInfo(status=api_pb2.STATUS_SUCCESS,
                                         end_time_secs=time.time())

    def summary(tag_name: str, **data) -> Any:
        content = plugin_data_pb2.HParamsPluginData(version=HPARAMS_VERSION, **data)
        meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(
            plugin_name=HPARAMS_PLUGIN, content=content.SerializeToString()))
        return Summary(value=[Summary.Value(tag=tag_name, metadata=meta)])

    return [summary(HPARAMS_TAG + "experiment", experiment=experiment),
            summary(HPARAMS_TAG + "session_start_info", session_start_info=start),
            summary(HPARAMS_TAG + "session_end_info", session_end_info=end)]


class Board:
    """The two TensorBoard runs of one training run (rank 0 only)."""

    def __init__(self, tb_dir: Path, start_step: int, config_text: str):
        from train.observe.events import EventWriter
        # purge_step: after a resume, the rerun's events replace those past the checkpoint
        self._writer = lambda name: EventWriter(tb_dir / name, purge_step=start_step + 1)
        self.train = self._writer("train")
        self.val = None  # created by the first evaluation
        self.train.text("config", "```\n" + config_text + "\n```", start_step)

    def log_train(self, step: int, values: dict[str, float]) -> None:
        self.train.scalars(step, {tag(k, TRAIN_TAGS): v for k, v in values.items()})

    def note(self, step: int, name: str, text: str) -> None:
        """A line of text at a step (the Text tab): a straggler named, say."""
        self.train.text(name, text, step)

    def log_val(self, step: int, values: dict[str, float]) -> None:
        self.val = self.val or self._writer("val")
        self.val.scalars(step, {tag(k, VAL_TAGS): v for k, v in values.items()})

    def close(self, hparams: dict[str, Any] | None = None, metrics: list[str] = ()) -> None:
        """``metrics``: metrics.jsonl keys of the final evaluation (the HParams metrics)."""
        if hparams is not None:
            writer = self.val if metrics and self.val else self.train
            tags = [tag(k, VAL_TAGS) for k in metrics] if writer is self.val else ["loss"]
            for pb in hparams_summaries(ordered_hparams(hparams), tags):
                writer.summary(pb)
        for writer in (self.train, self.val):
            if writer is not None:
                writer.close()
