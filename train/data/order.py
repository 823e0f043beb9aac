"""The global sample order, and each rank's share of it.

The contract (docs/architecture.md, "Data order"): a permutation of the training samples
fixed by seed and epoch; optimizer step ``s`` consumes samples ``[s*G, (s+1)*G)`` of
the concatenated epochs (G = global batch size); rank r takes the r-th contiguous
slice of that batch and splits it into micro-batches. Nothing here depends on the world
size except which slice a rank takes, so a run resized between steps continues at
exactly the next sample.

Two shuffles (``data.shuffle``): ``windows`` permutes every training sample of the epoch
at once; ``blocks`` (:class:`BlockOrder`) keeps the samples of a few files together, so
that a dataset bigger than a node's cache is fetched about once per epoch.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class GlobalOrder:
    """The seeded, world-size-independent sequence of training sample indices: each epoch
    a permutation of all of them."""

    def __init__(self, num_samples: int, seed: int):
        if num_samples < 1:
            raise ValueError("no training samples")
        self.n, self.seed = num_samples, seed
        self._epoch, self._perm = -1, None

    def permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, self._draw(g)
        return self._perm

    def _draw(self, g: torch.Generator) -> torch.Tensor:
        return torch.randperm(self.n, generator=g)

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


class BlockOrder(GlobalOrder):
    """Each epoch: the files in a random order, cut into groups of consecutive files of
    at most ``group_bytes`` each; the samples of a group in a random order, group after
    group. So a step's samples come from the files of one group (two at its boundary),
    and while one group trains the next can be fetched: a cache of two groups' bytes
    fetches every file once per epoch.

    ``files``: (samples, bytes) of each file in the samples' sequence (file 0's samples
    are 0..n0-1, file 1's follow); only the first ``num_samples`` samples train (the tail
    is validation), so a file straddling that point trains its leading samples only.
    """

    def __init__(self, num_samples: int, seed: int, files: list[tuple[int, int]],
                 group_bytes: int):
        super().__init__(num_samples, seed)
        self.files, self.group_bytes = files, group_bytes
        self.starts, at = [], 0
        for count, _ in files:
            self.starts.append(at)
            at += count

    def _training_samples(self, k: int) -> range:
        start = self.starts[k]
        return range(start, min(start + self.files[k][0], self.n))

    def groups(self, epoch: int) -> list[list[int]]:
        """The files of each group of ``epoch``, in training order."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return self._groups(torch.randperm(len(self.files), generator=g).tolist())

    def spans(self, first_sample: int) -> Iterator[tuple[int, int, list[int]]]:
        """(first, end, files) of each group from the one holding position
        ``first_sample`` of the concatenated epochs on, without end."""
        epoch = first_sample // self.n
        at = epoch * self.n
        while True:
            for group in self.groups(epoch):
                end = at + sum(len(self._training_samples(k)) for k in group)
                if end > first_sample:
                    yield at, end, group
                at = end
            epoch += 1

    def _groups(self, files: list[int]) -> list[list[int]]:
        out: list[list[int]] = []
        held = self.group_bytes  # bytes in the last group: start a new one at once
        for k in files:
            if not self._training_samples(k):
                continue
            size = self.files[k][1]
            if out and held + size <= self.group_bytes:
                out[-1].append(k)
                held += size
            else:
                out.append([k])
                held = size
        return out

    def _draw(self, g: torch.Generator) -> torch.Tensor:
        order = torch.randperm(len(self.files), generator=g).tolist()
        parts = []
        for group in self._groups(order):
            samples = torch.cat([torch.arange(r.start, r.stop) for r in
                                 (self._training_samples(k) for k in group)])
            parts.append(samples[torch.randperm(len(samples), generator=g)])
        return torch.cat(parts)


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
