"""``train.loss``: what the trainer minimises, by name or by the user's import path.

- ``cross_entropy``: class logits (or next-token logits) against integer targets; the
  logits' last dimension is the classes, every other dimension is flattened.
- ``mse``: mean squared error of outputs against targets of the same shape (regression).
- ``model``: the model's own loss: it is called as ``model(inputs, labels=targets)`` and
  returns it as ``loss`` (a Hugging Face model given labels does).
- ``package.module:name``: the user's ``fn(outputs, targets) -> scalar tensor``.

What a model returns: a tensor of logits, or what Hugging Face models return (a
``ModelOutput``), a dict with ``logits``, or a tuple whose first item is the logits. The
built-in losses and the accuracy take the logits out of it (:func:`logits_of`); the
user's own loss gets the output as the model returned it.

A model and a loss that do not fit fail the same way on every batch and every restart,
so each worker runs them once on one training sample before step 1
(:meth:`Objective.check`): a mismatch is one line naming what the model returned and
what the loss expects, exit 2, which torchrun's restarts do not repeat.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from train.core.errors import CannotRunHere, ConfigError
from train.core.user import usercode
from train.models.autobatch import is_out_of_memory

Loss = Callable[[Any, torch.Tensor], torch.Tensor]
MODEL_LOSS = "model"  # train.loss: the model's own loss
LOGITS = ("a tensor, a ModelOutput or dict with `logits`, or a tuple whose first item is the "
          "logits")


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(outputs.float(), targets.float().reshape(outputs.shape))


# Every name of train.core.config.kinds.BUILT_IN_LOSSES (the launcher's checks): these
# functions, and MODEL_LOSS.
BUILT_IN: dict[str, Loss] = {"cross_entropy": cross_entropy, "mse": mse}
NAMES = (*BUILT_IN, MODEL_LOSS)


class OutputMismatch(TypeError):
    """The model's output lacks what the loss needs (its logits, or its own loss)."""


def logits_of(outputs: Any) -> torch.Tensor:
    """The logits in what a model returned (the module docstring lists the forms)."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping):  # ModelOutput is an OrderedDict of its non-None fields
        logits = outputs.get("logits")
    elif isinstance(outputs, (tuple, list)) and outputs:
        logits = outputs[0]
    else:
        logits = getattr(outputs, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise OutputMismatch(f"no logits in {describe(outputs)}")
    return logits


def own_loss(outputs: Any) -> torch.Tensor:
    """The loss a model computed itself (``train.loss: model``)."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise OutputMismatch(f"no `loss` in {describe(outputs)}")
    return loss


class Objective:
    """How one batch becomes the loss of ``train.loss``: the model called on the inputs
    (with ``labels=`` for the model's own loss), then the loss of its outputs."""

    def __init__(self, name: str, source: str) -> None:
        self.name, self.source = name, source
        self.own = name == MODEL_LOSS
        self.fn = None if self.own else (BUILT_IN.get(name)
                                         or usercode.resolve(name, "train.loss", source))
        self.wants_logits = name in BUILT_IN

    def __call__(self, model: torch.nn.Module, x: torch.Tensor,
                 y: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """(the loss, the model's outputs)."""
        outputs = model(x, labels=y) if self.own else model(x)
        return self.loss(outputs, y), outputs

    def loss(self, outputs: Any, y: torch.Tensor) -> torch.Tensor:
        if self.own:
            return own_loss(outputs)
        return self.fn(logits_of(outputs) if self.wants_logits else outputs, y)

    def check(self, module: torch.nn.Module, sample: tuple[torch.Tensor, torch.Tensor],
              autocast, model_key: str) -> None:
        """Run the model and the loss on one sample (a batch of one): a forward that fails,
        an output without what the loss needs, a loss that cannot compare it with the
        target, or that is no differentiable scalar is a ConfigError (exit 2); running out of
        memory is CannotRunHere (exit 3: the machine, not the config). Eval mode (no dropout,
        no random numbers drawn), no backward; nothing is kept."""
        x, y = sample
        was_training = module.training
        module.eval()
        try:
            with autocast():
                outputs = self._forward(module, x, y, model_key)
                loss = self._loss(outputs, y)
        finally:
            module.train(was_training)
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1
                and loss.is_floating_point()):
            raise ConfigError(self.source, "train.loss", (
                f"{self.name} returned {describe(loss)}; a loss must be a tensor of one "
                "floating-point value (the batch's mean)"))
        if not loss.requires_grad and any(p.requires_grad for p in module.parameters()):
            raise ConfigError(self.source, "train.loss", (
                f"{self.name} returned a loss without a gradient (detached from the model's "
                "parameters); compute it from the model's outputs with torch operations"))

    def _forward(self, module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                 model_key: str) -> Any:
        try:
            return module(x, labels=y) if self.own else module(x)
        except Exception as exc:
            if is_out_of_memory(exc):  # this machine's limit, not the config's mistake
                raise CannotRunHere(
                    f"{self.source}: {model_key}: the model runs out of memory on one "
                    f"training sample (inputs {describe(x)}): {_first_line(exc)}; use a "
                    "machine with more memory, a smaller model, precision=bf16, "
                    "memory.activation_checkpointing=full or distributed.strategy=fsdp"
                ) from None
            if _machine_error(exc):
                raise
            if self.own:
                raise ConfigError(self.source, "train.loss", (
                    f"model calls the model as model(inputs, labels=targets), which failed on "
                    f"sample 0 (inputs {describe(x)}, targets {describe(y)}): "
                    f"{_first_line(exc)}; a model without its own loss needs cross_entropy, "
                    "mse or your fn(outputs, targets)")) from None
            raise ConfigError(self.source, model_key, (
                f"the model fails on training sample 0 (inputs {describe(x)}): "
                f"{_first_line(exc)}")) from None

    def _loss(self, outputs: Any, y: torch.Tensor) -> torch.Tensor:
        try:
            return self.loss(outputs, y)
        except OutputMismatch:
            what = "its own loss as `loss` when called with labels=" if self.own else \
                f"the model's logits ({LOGITS})"
            raise ConfigError(self.source, "train.loss", (
                f"{self.name} needs {what}; the model returned {describe(outputs)}")) from None
        except Exception as exc:
            if _machine_error(exc):
                raise
            raise ConfigError(self.source, "train.loss", (
                f"{self.name} cannot compare the model's outputs {describe(outputs)} with the "
                f"targets {describe(y)}: {_first_line(exc)}; choose a loss for these "
                "(cross_entropy: class logits against integer labels; mse: outputs and "
                "targets of one shape; model: the model's own loss)")) from None


def describe(value: Any, depth: int = 0) -> str:
    """What a model or a loss returned, in a few words: shapes and dtypes of tensors, the
    type and fields of a ModelOutput, dict or tuple."""
    if isinstance(value, torch.Tensor):
        return f"{list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if depth > 0 or not isinstance(value, (Mapping, tuple, list)):
        return type(value).__name__
    if isinstance(value, Mapping):
        fields = ", ".join(f"{k}={describe(v, 1)}" for k, v in list(value.items())[:6])
    else:
        fields = ", ".join(describe(v, 1) for v in value[:6])
    more = ", ..." if len(value) > 6 else ""
    return f"{type(value).__name__}({fields}{more})"


def _machine_error(exc: BaseException) -> bool:
    """Out of memory or an accelerator's error: this machine, not the config."""
    return isinstance(exc, torch.OutOfMemoryError) or bool(
        re.search(r"out of memory|device-side|\b(CUDA|HIP|cuDNN|cuBLAS|NCCL|RCCL)\b", str(exc)))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:200]}"
