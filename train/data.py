"""Datasets and the global sample order.

The order contract (docs/architecture.md, "Data order"): a permutation of the training samples
fixed by seed and epoch; optimizer step ``s`` consumes samples ``[s*G, (s+1)*G)`` of
the concatenated epochs (G = global batch size); rank r takes the r-th contiguous
slice of that batch and splits it into micro-batches. Nothing here depends on the world
size except which slice a rank takes, so a run resized between steps continues at
exactly the next sample.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset, default_collate

from train.core import usercode
from train.core.config import Config, DataConfig
from train.core.config.kinds import DATA_KINDS, MODEL_KINDS, load_builder
from train.core.datafiles import check_labels, load_npy, load_pt, text_files
from train.core.errors import ConfigError
from train.core.files import sha256_file
from train.dataloader import Loader, loader_worker_init

# Hashing a multi-GB token file at every start would cost minutes; above this size the
# manifest records a hash of the size plus sampled chunks and says so.
FULL_HASH_LIMIT = 256 << 20


class ArrayDataset(Dataset):
    """In-memory features and labels; fetches whole micro-batches at once."""

    def __init__(self, features: torch.Tensor, labels: torch.Tensor):
        self.features, self.labels = features, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.features[i], self.labels[i]

    def __getitems__(self, indices: list[int]):
        idx = torch.as_tensor(indices)
        return self.features[idx], self.labels[idx]


class WindowDataset(Dataset):
    """Next-token windows over a 1-D token array: sample i is tokens [i*L, i*L+L+1)."""

    def __init__(self, tokens: np.ndarray, length: int, first: int, count: int,
                 vocab_size: int = 1 << 16, source: str = ""):
        self.tokens, self.length, self.first, self.count = tokens, length, first, count
        self.vocab_size, self.source = vocab_size, source

    def __len__(self) -> int:
        return self.count

    def _window(self, i: int) -> np.ndarray:
        start = (self.first + i) * self.length
        return np.asarray(self.tokens[start:start + self.length + 1], dtype=np.int64)

    def __getitem__(self, i: int):
        w = torch.from_numpy(self._window(i))
        return w[:-1], w[1:]

    def __getitems__(self, indices: list[int]):
        w = torch.from_numpy(np.stack([self._window(i) for i in indices]))
        if self.vocab_size < 1 << 16 and int(w.max()) >= self.vocab_size:
            raise ValueError(f"{self.source}: token id {int(w.max())} >= data.vocab_size="
                             f"{self.vocab_size}")
        return w[:, :-1], w[:, 1:]


def already_batched(batch):
    """collate_fn for datasets whose __getitems__ returns a whole batch."""
    return batch


@dataclass
class DataBundle:
    train: Dataset
    val: Dataset
    input_shape: tuple[int, ...]
    num_classes: int  # vocabulary size for token data
    tokens_per_sample: int  # 0 for classification
    data_hash: str
    description: str


def _split_counts(n: int, val_fraction: float) -> tuple[int, int]:
    n_val = int(n * val_fraction)
    if val_fraction > 0 and n_val == 0 and n >= 2:
        n_val = 1
    return n - n_val, n_val


def _array_bundle(features: torch.Tensor, labels: torch.Tensor, cfg: DataConfig,
                  data_hash: str, description: str) -> DataBundle:
    n_train, _ = _split_counts(len(labels), cfg.val_fraction)
    num_classes = int(labels.max().item()) + 1 if len(labels) else 0
    return DataBundle(ArrayDataset(features[:n_train], labels[:n_train]),
                      ArrayDataset(features[n_train:], labels[n_train:]),
                      tuple(features.shape[1:]), max(num_classes, 2), 0, data_hash, description)


def synthetic(cfg: Config, source: str) -> DataBundle:
    """Gaussian inputs labelled by a fixed random teacher: learnable, exact from the seed."""
    d = cfg.data
    g = torch.Generator().manual_seed(cfg.seed + 0x5EED)
    x = torch.randn(d.num_samples, *d.shape, generator=g)
    teacher = torch.randn(int(np.prod(d.shape)), d.num_classes, generator=g)
    y = (x.flatten(1) @ teacher).argmax(dim=1)
    digest = hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()
    bundle = _array_bundle(x, y, d, digest, f"synthetic {d.num_samples}x{d.shape}")
    bundle.num_classes = d.num_classes
    return bundle


def _file_hash(path: Path) -> str:
    size = path.stat().st_size
    if size <= FULL_HASH_LIMIT:
        return sha256_file(path)
    h = hashlib.sha256()
    with path.open("rb") as f:
        h.update(str(size).encode())
        for k in range(64):  # 64 evenly spaced 1 MiB chunks
            f.seek(k * (size - (1 << 20)) // 63)
            h.update(f.read(1 << 20))
    return "sampled:" + h.hexdigest()


def tensors(cfg: Config, source: str) -> DataBundle:
    d = cfg.data
    path = Path(d.path)
    if path.suffix == ".pt":
        x, y = load_pt(path, mmap=False)
        digest = _file_hash(path)
        where, key = str(path), "data.path"
    else:
        x, y = (torch.from_numpy(np.array(load_npy(Path(f), k, mmap=False)))
                for f, k in ((path, "data.path"), (d.labels_path, "data.labels_path")))
        digest = hashlib.sha256((_file_hash(path) + _file_hash(Path(d.labels_path)))
                                .encode()).hexdigest()
        where, key = str(d.labels_path), "data.labels_path"
    check_labels(tuple(x.shape), y.numpy(), where, key)
    return _array_bundle(x.float(), y.long(), d, digest,
                         f"tensors {path.name} {tuple(x.shape)}")


def read_text_corpus(root: Path, glob: str, max_bytes: int) -> bytes:
    """Files under root matching glob in sorted order, concatenated, cut at max_bytes."""
    parts, total = [], 0
    for p in text_files(root, glob):
        blob = p.read_bytes()
        if max_bytes:
            blob = blob[: max_bytes - total]
        parts.append(blob)
        total += len(blob)
        if max_bytes and total >= max_bytes:
            break
    return b"".join(parts)


def _windows(tokens: np.ndarray, cfg: DataConfig, length: int, vocab: int, data_hash: str,
             description: str, source: str) -> DataBundle:
    n = (len(tokens) - 1) // length
    if n < 2:
        raise ConfigError(source, "data.path", f"only {len(tokens)} tokens; need at least "
                                               f"{2 * length + 1} for "
                                               f"model.context_length={length}")
    n_train, n_val = _split_counts(n, cfg.val_fraction)
    return DataBundle(WindowDataset(tokens, length, 0, n_train, vocab, source),
                      WindowDataset(tokens, length, n_train, n_val, vocab, source),
                      (length,), vocab, length, data_hash, description)


def default_text_root() -> str:
    """The standard library's source directory: real text on every machine, no download."""
    import sysconfig
    return sysconfig.get_paths()["stdlib"]


def text(cfg: Config, source: str) -> DataBundle:
    d = cfg.data
    root = Path(d.path or default_text_root())
    corpus = read_text_corpus(root, d.text_glob, d.max_bytes)
    ids = np.frombuffer(corpus, dtype=np.uint8)
    return _windows(ids, d, cfg.model.context_length, 256, hashlib.sha256(corpus).hexdigest(),
                    f"text {root} ({len(corpus):,} bytes)", str(root))


def tokens(cfg: Config, source: str) -> DataBundle:
    d = cfg.data
    path = Path(d.path)
    ids = np.memmap(path, dtype=np.uint16, mode="r")
    return _windows(ids, d, cfg.model.context_length, d.vocab_size, _file_hash(path),
                    f"tokens {path.name} ({len(ids):,} tokens)", str(path))


class SampleDataset(Dataset):
    """The user's map-style dataset, batched the way the loader and evaluation fetch:
    ``__getitems__`` collates samples with torch's default collate."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        return self.dataset[i]

    def __getitems__(self, indices: list[int]):
        return default_collate([self.dataset[i] for i in indices])


def from_factory(cfg: Config, source: str) -> DataBundle:
    """data.kind custom: the user's factory (train.core.usercode); a validation set of its
    own, or the tail data.val_fraction of the training set."""
    d = cfg.data
    train, val = usercode.split_datasets(usercode.call(d.factory, d.args, "data", source),
                                         source)
    x, _ = usercode.first_sample(train, source)
    if val is None:
        n_train, n_val = _split_counts(len(train), d.val_fraction)
        train, val = Subset(train, range(n_train)), Subset(train, range(n_train, n_train + n_val))
    token_model = MODEL_KINDS[cfg.model.kind].tokens
    classes = d.vocab_size if token_model else d.num_classes
    digest = hashlib.sha256(json.dumps({"factory": d.factory, "args": d.args}, sort_keys=True,
                                       default=str).encode()).hexdigest()
    per_sample = cfg.model.context_length if token_model else 0
    return DataBundle(SampleDataset(train), SampleDataset(val), tuple(torch.as_tensor(x).shape),
                      classes, per_sample, f"custom:{digest}",
                      f"custom {d.factory} ({len(train):,} + {len(val):,} samples)")


def build_data(cfg: Config, source: str = "config") -> DataBundle:
    """The data of ``data.kind`` (its builder, from train.core.config.kinds)."""
    return load_builder(DATA_KINDS[cfg.data.kind].builder)(cfg, source)


# ------------------------------------------------------------------------- the order

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


def make_loader(dataset: Dataset, batch_sampler, *, num_workers: int, pin_memory: bool,
                persistent_workers: bool, prefetch_factor: int, seed: int,
                worker_init_fn=None) -> DataLoader:
    """``worker_init_fn(worker_id)``: runs in each worker after the signal setup of
    :mod:`train.dataloader`."""
    extra = {}
    if num_workers > 0:
        extra = {"persistent_workers": persistent_workers, "prefetch_factor": prefetch_factor,
                 "worker_init_fn": loader_worker_init(worker_init_fn)}
    return Loader(dataset, batch_sampler=batch_sampler, num_workers=num_workers,
                  pin_memory=pin_memory, collate_fn=already_batched,
                  generator=torch.Generator().manual_seed(seed), **extra)


def eval_indices(num_val: int, eval_batches: int, global_batch_size: int, rank: int,
                 world_size: int) -> list[int]:
    """This rank's share of the fixed validation subset (same subset for any world size)."""
    total = min(num_val, eval_batches * global_batch_size)
    per_rank = -(-total // world_size)
    return list(range(rank * per_rank, min(total, (rank + 1) * per_rank)))
