"""The data of each ``data.kind``: its builder reads files (or makes synthetic
samples) and returns a :class:`DataBundle` of map-style datasets, with batched
``__getitems__`` where that pays, and a hash of what it read for the manifest.

Which builder serves a kind is :data:`train.core.config.kinds.DATA_KINDS`' entry; the
files are checked by the launcher before any worker starts (:mod:`train.core.datasets.datafiles`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, Subset, default_collate

from train.core.config import Config, DataConfig
from train.core.config.kinds import DATA_KINDS, MODEL_KINDS, load_builder
from train.core.datasets import tokenfiles
from train.core.datasets.datafiles import (
    check_labels,
    is_text_folder,
    load_npy,
    load_pt,
    text_files,
)
from train.core.datasets.tokenfiles import TokenFile
from train.core.errors import ConfigError
from train.core.files import sha256_file
from train.core.user import usercode
from train.data import remote
from train.data.shardcache import ShardCache, default_folder
from train.data.tokenfile import read_sidecar
from train.data.tokenshards import ShardedWindows, Shards, Windows, windows_in

log = logging.getLogger("train")

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


class WindowDataset(Windows):
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

    def _source_of(self, index: int) -> str:
        return self.source


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
    return _joined((p.read_bytes() for p in text_files(root, glob)), max_bytes)


def _joined(blobs: Iterator[bytes], max_bytes: int) -> bytes:
    """The blobs concatenated, cut at max_bytes (0: all); read no further than needed."""
    parts, total = [], 0
    for blob in blobs:
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
    """Bytes of text: the files under a folder matching data.text_glob, or the files and
    objects data.path names (:mod:`train.core.datasets.tokenfiles`), in order, up to max_bytes."""
    d = cfg.data
    if is_text_folder(d.path):
        root = Path(d.path or default_text_root())
        corpus, where = read_text_corpus(root, d.text_glob, d.max_bytes), str(root)
    else:
        files = tokenfiles.resolve(d.path, source, "text")
        corpus = read_text_files(files, d.max_bytes, _cache(d))
        where = files[0].name if len(files) == 1 else f"{len(files)} files"
    ids = np.frombuffer(corpus, dtype=np.uint8)
    return _windows(ids, d, cfg.model.context_length, 256, hashlib.sha256(corpus).hexdigest(),
                    f"text {where} ({len(corpus):,} bytes)", where)


def read_text_files(files: list[TokenFile], max_bytes: int, cache: ShardCache) -> bytes:
    """The files concatenated in order, cut at max_bytes; objects come through ``cache``
    (fetched once per node, checked), those that will be read fetched in the background
    while the first ones are read."""
    needed, total = [], 0
    for f in files:
        if max_bytes and total >= max_bytes:
            break
        needed.append(f)
        total += f.size
    if any(f.remote for f in needed):
        cache.read_ahead([f for f in needed if f.remote])
    return _joined(((cache.local(f) if f.remote else Path(f.name)).read_bytes()
                    for f in needed), max_bytes)


def _cache(d: DataConfig) -> ShardCache:
    return ShardCache(Path(d.cache_dir) if d.cache_dir else default_folder(), d.cache_bytes)


def tokens(cfg: Config, source: str) -> DataBundle:
    d = cfg.data
    files = tokenfiles.resolve(d.path, source)
    if len(files) > 1 or files[0].remote:
        return sharded_tokens(cfg, files, source)
    path = Path(files[0].name)  # one local file: read as it always was
    ids = np.memmap(path, dtype=np.uint16, mode="r")
    return _windows(ids, d, cfg.model.context_length, d.vocab_size, _file_hash(path),
                    f"tokens {path.name} ({len(ids):,} tokens{_made_by(path)})", str(path))


def _made_by(path: Path) -> str:
    """Which tokenizer made a token file (``tokenize``'s FILE.json), for the manifest."""
    made = (read_sidecar(path) or {}).get("tokenizer")
    if not isinstance(made, dict) or not isinstance(made.get("sha256"), str):
        return ""
    return f", tokenizer.json sha256 {made['sha256']}"


def sharded_tokens(cfg: Config, files: list[TokenFile], source: str) -> DataBundle:
    """Several token files, or objects, as one sequence of windows (:mod:`.tokenshards`)."""
    d, length = cfg.data, cfg.model.context_length
    shards = Shards(files, _cache(d))
    n = sum(windows_in(f, length) for f in files)
    if n < 2:
        raise ConfigError(source, "data.path", f"{n} window(s) of model.context_length="
                                               f"{length} tokens in {len(files)} file(s); "
                                               "need at least 2")
    fetched = sum(f.size for f in files if f.remote)
    if fetched > d.cache_bytes and d.shuffle == "windows":
        log.warning("data.cache_bytes=%d holds less than the %d bytes of objects in "
                    "data.path: every step will fetch files again (a full shuffle reads "
                    "them all; docs/object-storage.md); set data.shuffle=blocks to fetch "
                    "each once an epoch, or raise data.cache_bytes to %d", d.cache_bytes,
                    fetched, fetched)
    n_train, n_val = _split_counts(n, d.val_fraction)
    # objects: their listing (size, ETag) stands for their bytes, which are not here yet
    digest = hashlib.sha256(json.dumps(
        [[f.name, f.size, f.etag or _file_hash(Path(f.name))] for f in files]).encode())
    return DataBundle(ShardedWindows(shards, length, 0, n_train, d.vocab_size),
                      ShardedWindows(shards, length, n_train, n_val, d.vocab_size),
                      (length,), d.vocab_size, length, "files:" + digest.hexdigest(),
                      f"tokens {len(files)} files ({sum(f.size for f in files) // 2:,} "
                      "tokens)")


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
    """data.kind custom: the user's factory (train.core.user.usercode); a validation set of its
    own, or the tail data.val_fraction of the training set."""
    d = cfg.data
    remote.use_cache(d.cache_dir, d.cache_bytes)  # where the factory's fetch() keeps copies
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
