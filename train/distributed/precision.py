"""``precision: fp32 | bf16 | fp16`` as torch sees it: the autocast dtype and the grad scaler."""

from __future__ import annotations

import contextlib

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(precision: str) -> torch.dtype | None:
    """None for fp32 (no autocast)."""
    return DTYPES.get(precision)


def autocast(device_type: str, precision: str):
    """The context that runs a forward pass at ``precision``."""
    dtype = autocast_dtype(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


def grad_scaler(device_type: str, precision: str) -> torch.amp.GradScaler | None:
    """fp16 needs loss scaling (its range underflows small gradients); bf16 does not."""
    return torch.amp.GradScaler(device_type) if precision == "fp16" else None
