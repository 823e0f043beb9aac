"""``train.loss``: what the trainer minimises, by name or by the user's import path.

- ``cross_entropy``: class logits (or next-token logits) against integer targets; the
  logits' last dimension is the classes, every other dimension is flattened.
- ``mse``: mean squared error of outputs against targets of the same shape (regression).
- ``package.module:name``: the user's ``fn(outputs, targets) -> scalar tensor``.

Accuracy is reported for cross_entropy only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from train.core import usercode
from train.core.errors import ConfigError

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(outputs.float(), targets.float().reshape(outputs.shape))


# The names train.core.config.kinds.BUILT_IN_LOSSES lists for the launcher's checks.
BUILT_IN: dict[str, Loss] = {"cross_entropy": cross_entropy, "mse": mse}


def resolve(name: str, source: str) -> Loss:
    """The loss ``name`` names, checked on its first call (:class:`FirstCallChecked`)."""
    return FirstCallChecked(BUILT_IN.get(name) or usercode.resolve(name, "train.loss", source),
                            name, source)


class FirstCallChecked:
    """A loss that fails on the first batch (outputs and targets of shapes or types it
    cannot compare: ``mse`` on class labels) fails on every batch, on every restart: one
    line, exit 2 (which torchrun's restarts do not repeat), naming both shapes."""

    def __init__(self, fn: Loss, name: str, source: str) -> None:
        self.fn, self.name, self.source, self.checked = fn, name, source, False

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.checked:
            return self.fn(outputs, targets)
        try:
            value = self.fn(outputs, targets)
        except (RuntimeError, ValueError, TypeError, IndexError) as exc:
            if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc):
                raise  # the machine, not the config
            raise ConfigError(self.source, "train.loss", (
                f"{self.name} cannot compare the model's outputs {_shape(outputs)} with the "
                f"targets {_shape(targets)}: {_first_line(exc)}; choose a loss for these "
                "(cross_entropy: class logits against integer labels; mse: outputs and "
                "targets of one shape)")) from None
        self.checked = True
        return value


def _shape(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"
    return type(t).__name__


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:200]}"
