"""A ``data.kind: tokens`` dataset made of several files (local, or ``s3://`` objects).

The files form one sequence of windows: file 0's windows, then file 1's, and so on,
each file cut into windows exactly as a single file is (window j of a file is its
tokens ``[j*L, j*L+L+1)``; the tail shorter than a window is left out). A window never
crosses from one file into the next: a file boundary is usually a document boundary,
and the window count of each file is then known from its size alone, before any byte is
fetched. The global sample order (:mod:`.order`) is a permutation of these windows
fixed by seed and epoch, the same whatever the world size and resume point, exactly as
for one file; the validation windows are the tail of the sequence.

Objects are read from local copies (:mod:`.shardcache`); :meth:`ShardedWindows.read_ahead`
fetches them in the order the rank's batches first need them, so the first steps wait
only for the files they read and later steps for none.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from train.core.datasets.footprint import windows_in
from train.core.datasets.tokenfiles import TokenFile
from train.core.errors import BadData
from train.data.order import BlockOrder
from train.data.shardcache import ShardCache

# How often the read-ahead of data.shuffle: blocks looks whether training reached the
# group before the one it fetches next
GROUP_WAIT_S = 0.2
# How often a process looks whether the cache still holds a file it has mapped: a map
# keeps an evicted file's pages readable, and its disk space taken, until it is dropped
RECHECK_S = 1.0


class Shards:
    """The token arrays of a dataset's files, mapped on first use in each process."""

    def __init__(self, files: list[TokenFile], cache: ShardCache | None):
        self.files, self.cache = files, cache
        self._arrays: dict[int, tuple[Path, np.ndarray, float]] = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_arrays": {}}  # a map is never copied into a worker

    def tokens(self, k: int) -> np.ndarray:
        f, known = self.files[k], self._arrays.get(k)
        if known is not None:
            path, array, checked = known
            now = time.monotonic()
            if not f.remote or now - checked < RECHECK_S:
                return array
            if path.exists():
                self._arrays[k] = (path, array, now)
                return array
        path = self.cache.local(f) if f.remote else Path(f.name)  # evicted: fetched again
        self._arrays[k] = (path, np.memmap(path, dtype=np.uint16, mode="r"), time.monotonic())
        return self._arrays[k][1]


class Windows(Dataset):
    """Next-token windows of ``length + 1`` tokens: (input, target) pairs shifted by one.
    A subclass says where window i lies (``_window``) and which file a row came from
    (``_source_of``), for the one-line error on an id outside the vocabulary."""

    length: int
    vocab_size: int

    def _window(self, i: int) -> np.ndarray:
        raise NotImplementedError

    def _source_of(self, index: int) -> str:
        raise NotImplementedError

    def __getitem__(self, i: int):
        w = torch.from_numpy(self._window(i))
        return w[:-1], w[1:]

    def __getitems__(self, indices: list[int]):
        w = torch.from_numpy(np.stack([self._window(i) for i in indices]))
        # uint16 files hold ids up to 65535: only a smaller vocabulary can be exceeded
        if self.vocab_size < 1 << 16 and int(w.max()) >= self.vocab_size:
            row = int(w.max(dim=1).values.argmax())
            raise BadData(f"{self._source_of(indices[row])}: token id {int(w.max())} >= "
                          f"data.vocab_size={self.vocab_size}; raise data.vocab_size to "
                          f"{int(w.max()) + 1} or more, or tokenize with a tokenizer of "
                          "that many ids")
        return w[:, :-1], w[:, 1:]


class ShardedWindows(Windows):
    """Windows ``[first, first+count)`` of the files' sequence of windows."""

    def __init__(self, shards: Shards, length: int, first: int, count: int, vocab_size: int):
        self.shards, self.length, self.first, self.count = shards, length, first, count
        self.vocab_size = vocab_size
        counts = [windows_in(f, length) for f in shards.files]
        self.starts = [0, *itertools.accumulate(counts)]  # each file's first window

    def __len__(self) -> int:
        return self.count

    def file_of(self, i: int) -> int:
        return bisect.bisect_right(self.starts, self.first + i) - 1

    def _window(self, i: int) -> np.ndarray:
        k = self.file_of(i)
        start = (self.first + i - self.starts[k]) * self.length
        return np.asarray(self.shards.tokens(k)[start:start + self.length + 1], dtype=np.int64)

    def _source_of(self, index: int) -> str:
        return self.shards.files[self.file_of(index)].name

    def files_needed(self, batches: Iterable[list[int]]) -> Iterator[TokenFile]:
        """The remote files ``batches`` read, each once, in the order first read."""
        seen: set[int] = set()
        wanted = {k for k, f in enumerate(self.shards.files) if f.remote}
        for batch in batches:
            for i in batch:
                k = self.file_of(i)
                if k in wanted and k not in seen:
                    seen.add(k)
                    yield self.shards.files[k]
            if seen == wanted:
                return

    def layout(self) -> list[tuple[int, int]]:
        """(windows, bytes) of each file, in the windows' sequence: what
        ``data.shuffle: blocks`` groups (:class:`~train.data.order.BlockOrder`)."""
        return [(end - start, f.size) for start, end, f in
                zip(self.starts[:-1], self.starts[1:], self.shards.files, strict=True)]

    def read_ahead_groups(self, order: BlockOrder, first: int, last: int,
                          position: Callable[[], int]) -> None:
        """``data.shuffle: blocks``: fetch, in the background, each group's objects once
        the group before it trains (``position()``: the samples trained so far),
        for positions ``[first, last)``. The cache holds two groups: the one training and
        the one arriving."""
        if self.shards.cache is None or not any(f.remote for f in self.shards.files):
            return
        cache, files = self.shards.cache, self.shards.files

        def run() -> None:
            previous = None  # where the group before this one begins
            for start, end, group in order.spans(first):
                if start >= last:
                    return
                while previous is not None and position() < previous:
                    time.sleep(GROUP_WAIT_S)
                previous = start
                if end <= position():
                    continue  # trained already (the reader fetched what it needed)
                if not cache.fetch_all_ahead(files[k] for k in group if files[k].remote):
                    return  # the reader that needs it says so, in its own step
        threading.Thread(target=run, name="data-read-ahead", daemon=True).start()

    def read_ahead(self, batches: Iterable[list[int]]) -> None:
        """Fetch, in the background, the objects ``batches`` (this rank's, in order) read."""
        if self.shards.cache is not None and any(f.remote for f in self.shards.files):
            self.shards.cache.read_ahead(self.files_needed(batches))
