"""``train.micro_batch_size: auto`` on GPU: the largest micro-batch that fits.

Tries divisors of the per-rank batch from the largest down, with one forward and
backward pass of the plain (unwrapped) module each, so no collective runs while a rank
may be out of memory; the ranks then agree on the smallest size that fit everywhere.
Optimizer state is not allocated yet at probe time, so a size counts as fitting only
with room left for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from train.core.errors import CannotRunHere

log = logging.getLogger("train")

# Fraction of GPU memory the probe may fill, leaving room for fragmentation and the
# loader's pinned batches.
MEMORY_BUDGET = 0.9


def divisors_descending(n: int) -> list[int]:
    return [m for m in range(n, 0, -1) if n % m == 0]


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's OutOfMemoryError, or a library's allocation failure (cuBLAS, cuDNN), or the
    CPU allocator's (host memory), which arrive as a plain RuntimeError; Python's own."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text.lower()
                                              or "ALLOC_FAILED" in text
                                              or "can't allocate memory" in text)


def largest_fitting(per_rank: int, fits: Callable[[int], bool]) -> int:
    """Largest divisor m of per_rank with fits(m); fits raises an out-of-memory error or
    says no."""
    for m in divisors_descending(per_rank):
        try:
            if fits(m):
                return m
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not is_out_of_memory(exc):
                raise
        log.info("micro-batch %d does not fit; trying a smaller one", m)
    raise CannotRunHere("train.micro_batch_size=auto: not even a micro-batch of 1 fits in GPU "
                        "memory; use a smaller model, precision=bf16, "
                        "memory.activation_checkpointing=full or distributed.strategy=fsdp")


def probe_on_gpu(module: torch.nn.Module, sample: Callable[[int], tuple], objective, autocast,
                 device: torch.device, extra_bytes: int) -> Callable[[int], bool]:
    """A fits(m) that runs one forward/backward of m samples and measures peak memory.

    The budget is the memory free before the probe (other processes, the CUDA context
    and NCCL's buffers already taken) plus what this process holds, times MEMORY_BUDGET;
    extra_bytes is what training adds later (optimizer state, DDP's gradient buckets).
    """
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    budget = MEMORY_BUDGET * (free + torch.cuda.memory_reserved(device))

    def fits(m: int) -> bool:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        try:
            x, y = (t.to(device) for t in sample(m))
            with autocast():
                loss, _ = objective(module, x, y)
            loss.backward()
            del x, y, loss
            return torch.cuda.max_memory_allocated(device) + extra_bytes < budget
        finally:
            module.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()

    return fits
