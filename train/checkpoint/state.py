"""What a checkpoint holds, in one place: the training progress and the payload layout.

:class:`TrainState` is the mutable progress of a run (step, position in the global
sample order). :func:`payload` and :class:`Restored` are the one save/restore pair for
``state.pt`` (written by rank 0): the trainer writes and resumes with them, ``export``
reads the model from them. Each rank also writes ``rank-<r>.pt`` with its RNG state
(:func:`rank_payload`), so an unchanged world size resumes bitwise.

``state.pt`` is a flat dict of tensors and plain values, loadable with
``torch.load(weights_only=True)``:

    step, samples_consumed, skipped_steps, world_size
                                         progress, and the world size it was saved at
    model, optimizer, scheduler, scaler  state dicts (full tensors, plain module names)
    config                               the resolved config (a dict)
    model_io                             {input_shape, num_classes}: what export needs
    format                               "full", or "sharded": then model and optimizer
                                         are None, their shards in model/ (DCP, written
                                         by every rank: train.checkpoint.sharded)
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class TrainState:
    """Progress: optimizer steps taken and samples consumed from the global order.

    samples_consumed equals step x global_batch_size unless the global batch size was
    changed on a resume; the data order continues from samples_consumed either way.
    """
    step: int = 0
    samples_consumed: int = 0
    skipped_steps: int = 0      # updates dropped for a non-finite gradient (train.nonfinite)

    def advance(self, global_batch_size: int) -> None:
        self.step += 1
        self.samples_consumed += global_batch_size

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "samples_consumed": self.samples_consumed,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, saved: dict[str, Any], global_batch_size: int) -> None:
        self.step = int(saved["step"])
        # Checkpoints written before samples_consumed existed: the batch size never changed.
        self.samples_consumed = int(saved.get("samples_consumed",
                                              self.step * global_batch_size))
        self.skipped_steps = int(saved.get("skipped_steps", 0))


def payload(state: TrainState, *, world_size: int, model: dict | None,
            optimizer: dict | None, scheduler: dict, scaler: dict | None, config: dict,
            model_io: dict[str, Any], format: str, data_sha256: str | None = None
            ) -> dict[str, Any]:
    """The contents of state.pt (model and optimizer None: sharded, beside it);
    ``data_sha256``: the hash of the data it trained on (a resume onto other data is
    refused, :func:`train.core.config.resume.check_same_data`)."""
    return {**state.state_dict(), "world_size": world_size, "model": model,
            "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler,
            "config": config, "model_io": model_io, "format": format,
            "data_sha256": data_sha256}


@dataclass(frozen=True)
class Restored:
    """state.pt read back."""
    raw: dict[str, Any]

    def train_state(self, global_batch_size: int) -> TrainState:
        state = TrainState()
        state.load_state_dict(self.raw, global_batch_size)
        return state

    @property
    def step(self) -> int:
        return int(self.raw["step"])

    @property
    def world_size(self) -> int | None:
        return self.raw.get("world_size")

    @property
    def format(self) -> str:
        return self.raw.get("format", "full")

    @property
    def data_sha256(self) -> str | None:
        """The hash of the data it trained on (None: written by an older version)."""
        return self.raw.get("data_sha256")

    @property
    def sharded(self) -> bool:
        return self.format == "sharded"

    @property
    def model(self) -> dict[str, torch.Tensor]:
        return self.raw["model"]

    @property
    def optimizer(self) -> dict:
        return self.raw["optimizer"]

    @property
    def scheduler(self) -> dict:
        return self.raw["scheduler"]

    @property
    def scaler(self) -> dict | None:
        return self.raw.get("scaler")

    @property
    def config(self) -> dict:
        return self.raw.get("config", {})

    @property
    def model_io(self) -> dict | None:
        return self.raw.get("model_io")


# ----------------------------------------------------------------- per-rank RNG state

def rank_payload(rank: int) -> dict[str, Any]:
    """The contents of rank-<r>.pt: this rank's RNG streams (dropout, data workers)."""
    return {"rng": rng_state(), "rank": rank}


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    # numpy's global stream exists once numpy.random is imported, seeded from the OS's
    # entropy unless code seeds it: before that there is nothing reproducible to keep,
    # and importing it here would cost the first save of every process some 50 ms
    if "numpy.random" in sys.modules:
        np_state = np.random.get_state()
        state["numpy"] = {"key": torch.from_numpy(np_state[1].astype(np.int64)),
                          "pos": int(np_state[2]), "has_gauss": int(np_state[3]),
                          "cached": float(np_state[4])}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_as_tuple(state["python"]))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        n = state["numpy"]
        np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"],
                             n["has_gauss"], n["cached"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value
