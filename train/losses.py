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

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(outputs.float(), targets.float().reshape(outputs.shape))


# The names train.core.config.kinds.BUILT_IN_LOSSES lists for the launcher's checks.
BUILT_IN: dict[str, Loss] = {"cross_entropy": cross_entropy, "mse": mse}


def resolve(name: str, source: str) -> Loss:
    return BUILT_IN.get(name) or usercode.resolve(name, "train.loss", source)
