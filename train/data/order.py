"""The global sample order, and each rank's share of it.

The contract (docs/architecture.md, "Data order"): a permutation of the training samples
fixed by seed and epoch; optimizer step ``s`` consumes samples ``[s*G, (s+1)*G)`` of
the concatenated epochs (G = global batch size); rank r takes the r-th contiguous
slice of that batch and splits it into micro-batches. Nothing here depends on the world
size except which slice a rank takes, so a run resized between steps continues at
exactly the next sample.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class GlobalOrder:
    """The seeded, world-size-independent sequence of training sample indices."""

    def __init__(self, num_samples: int, seed: int):
        if num_samples < 1:
            raise ValueError("no training samples")
        self.n, self.seed = num_samples, seed
        self._epoch, self._perm = -1, None

    def permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.n, generator=g)
        return self._perm

    def take(self, start: int, count: int) -> list[int]:
        """Indices at positions [start, start+count) of the concatenated epochs."""
        out: list[int] = []
        while count > 0:
            epoch, offset = divmod(start, self.n)
            chunk = self.permutation(epoch)[offset: offset + count].tolist()
            out += chunk
            start, count = start + len(chunk), count - len(chunk)
        return out

    def global_batch(self, step: int, global_batch_size: int) -> list[int]:
        return self.take(step * global_batch_size, global_batch_size)


class RankBatchSampler:
    """Yields this rank's micro-batches for steps [start_step, end_step)."""

    def __init__(self, order: GlobalOrder, *, global_batch_size: int, rank: int, world_size: int,
                 micro_batch_size: int, start_step: int, end_step: int,
                 first_sample: int | None = None):
        self.order, self.g, self.rank, self.world = order, global_batch_size, rank, world_size
        self.micro, self.start, self.end = micro_batch_size, start_step, end_step
        self.per_rank = global_batch_size // world_size
        # Where start_step's batch begins: start_step * G unless the global batch size
        # changed since the checkpoint (the checkpoint's samples_consumed then).
        self.first = start_step * global_batch_size if first_sample is None else first_sample

    def __len__(self) -> int:
        return (self.end - self.start) * (self.per_rank // self.micro)

    def __iter__(self) -> Iterator[list[int]]:
        for k in range(self.end - self.start):
            batch = self.order.take(self.first + k * self.g, self.g)
            mine = batch[self.rank * self.per_rank: (self.rank + 1) * self.per_rank]
            for i in range(0, self.per_rank, self.micro):
                yield mine[i: i + self.micro]


def eval_indices(num_val: int, eval_batches: int, global_batch_size: int, rank: int,
                 world_size: int) -> list[int]:
    """This rank's share of the fixed validation subset (same subset for any world size)."""
    total = min(num_val, eval_batches * global_batch_size)
    per_rank = -(-total // world_size)
    return list(range(rank * per_rank, min(total, (rank + 1) * per_rank)))
