"""How a checkpoint keeps the model and the optimizer, chosen once from the config:

- ``full``: rank 0 gathers full tensors into ``state.pt`` (FSDP gathers them on rank 0),
  so any strategy and world size, and ``export``, read it alone;
- ``sharded``: every rank writes its own shards beside it (``model/``, DCP:
  :mod:`.sharded`), so no rank ever holds the whole state; loading reshards.

Everything else a checkpoint holds (step, data position, schedule, RNG, config) is the
same in both (:mod:`.state`). A resume reads each checkpoint in the format it was saved
in, whatever the config now says.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from train.checkpoint import sharded
from train.checkpoint.state import Restored
from train.core.config import Config
from train.core.run.rundir import SHARDS


class Format(Protocol):
    name: str  # as state.pt records it ("format")

    def collect(self, model, optimizer, background: bool
                ) -> tuple[dict | None, dict | None, Any]:
        """Collective: (model state, optimizer state) for state.pt, or None for both when
        they go beside it; and the shard writer the store runs (or None)."""

    def load(self, model, optimizer, saved: Restored, path: Path) -> None:
        """Collective: the checkpoint at ``path`` (its state.pt read as ``saved``) into
        the model and optimizer."""


class Full:
    name = "full"

    def collect(self, model, optimizer, background: bool):
        from train.distributed.parallel import full_state
        model_state, optim_state = full_state(model, optimizer)
        return model_state, optim_state, None

    def load(self, model, optimizer, saved: Restored, path: Path) -> None:
        from train.distributed.parallel import load_full_state
        load_full_state(model, optimizer, saved.model, saved.optimizer)


class Sharded:
    name = "sharded"

    def collect(self, model, optimizer, background: bool):
        tensors = sharded.state_dicts(model, optimizer)  # this rank's: nothing gathered
        write = sharded.save_in_background if background else sharded.save
        return None, None, lambda folder: write(tensors, folder)

    def load(self, model, optimizer, saved: Restored, path: Path) -> None:
        sharded.load(model, optimizer, path / SHARDS)  # what this rank's shards need


FORMATS: dict[str, Format] = {f.name: f for f in (Full(), Sharded())}


def for_config(cfg: Config) -> Format:
    return FORMATS[Sharded.name if cfg.sharded_checkpoints else Full.name]


def of_checkpoint(saved: Restored) -> Format:
    """The format a checkpoint was saved in (older checkpoints: full)."""
    return FORMATS.get(saved.format, FORMATS[Full.name])
