"""What a ``data.kind: tokens`` dataset is, and what reading it fetches from object
storage per epoch and node: the figures ``doctor`` and ``train --dry-run`` show (and
``doctor --json`` carries under ``data``), computed from the listing alone, before any
byte is fetched.

The fetch per epoch and node follows from ``data.shuffle`` and ``data.cache_bytes``
(docs/object-storage.md, "Two orders"):

- ``blocks``: each object once an epoch, on each node: the dataset's object bytes. The
  groups are the files cut into runs of at most half the cache; each epoch shuffles the
  files first, so their number varies a little from epoch to epoch (the one shown packs
  them in listing order);
- ``windows`` with a cache that holds every object: each once per node, in the first
  epoch, and then never again;
- ``windows`` with a smaller cache: a window's file is in the cache with a chance of
  about the cache's share of the dataset, and a miss fetches its whole file (of the
  size the windows of the files weigh on average), so an epoch's windows on a node
  fetch about ``windows x (1 - share) x mean file size``: an estimate (least recently
  used eviction under a uniform shuffle), never less than the dataset itself.
"""

from __future__ import annotations

from train.core.config import Config
from train.core.datasets.tokenfiles import TokenFile


def windows_in(f: TokenFile, length: int) -> int:
    """The windows of ``length + 1`` tokens a uint16 token file holds (a file's tail
    shorter than a window is left out)."""
    return max(0, (f.size // 2 - 1) // length)


def groups_of(files: list[TokenFile], length: int, group_bytes: int) -> int:
    """How many groups of at most ``group_bytes`` the files make, packed as
    ``data.shuffle: blocks`` packs them (train.data.order.BlockOrder), in listing order."""
    count, held = 0, group_bytes
    for f in files:
        if not windows_in(f, length):
            continue
        if count and held + f.size <= group_bytes:
            held += f.size
        else:
            count, held = count + 1, f.size
    return count


def describe(cfg: Config, files: list[TokenFile], nodes: int = 1) -> dict:
    """The dataset and its fetch per epoch per node (``nodes``: how many share the
    windows of an epoch), as plain data (see the module's docstring)."""
    d, length = cfg.data, cfg.model.context_length
    objects = [f for f in files if f.remote]
    remote = sum(f.size for f in objects)
    windows = sum(windows_in(f, length) for f in files)
    out = {"files": len(files), "objects": len(objects), "bytes": sum(f.size for f in files),
           "object_bytes": remote, "tokens": sum(f.size // 2 for f in files),
           "windows": windows, "context_length": length, "shuffle": d.shuffle,
           "cache_bytes": d.cache_bytes, "cache_share": min(1.0, d.cache_bytes / remote)
           if remote else 1.0}
    if d.shuffle == "blocks":
        out["group_bytes"] = d.cache_bytes // 2
        out["groups"] = groups_of(files, length, d.cache_bytes // 2)
    out["fetch_per_epoch_bytes"] = _fetch_per_epoch(out, objects, windows * (1 - d.val_fraction)
                                                    / max(1, nodes))
    return out


def _fetch_per_epoch(out: dict, objects: list[TokenFile], windows_read: float) -> int:
    remote, share = out["object_bytes"], out["cache_share"]
    if not remote or out["shuffle"] == "blocks" or share >= 1:
        return remote
    mean_file = sum(f.size * f.size for f in objects) / remote  # weighed by their windows
    return max(remote, round(windows_read * (1 - share) * mean_file))


def size_text(n: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def lines(d: dict) -> list[str]:
    """``describe``'s figures in words: the dataset, then its order and fetch."""
    what = f"{d['files']} files" + (f" ({d['objects']} in object storage)" if d["objects"]
                                     else "")
    first = (f"tokens: {what}, {size_text(d['bytes'])}, {d['tokens']:,} tokens, "
             f"{d['windows']:,} windows of {d['context_length']} tokens")
    return [first, f"shuffle {d['shuffle']}: " + _order_text(d)]


def _order_text(d: dict) -> str:
    remote, fetch = d["object_bytes"], d["fetch_per_epoch_bytes"]
    ratio = fetch / remote if remote else 0
    times = f"{ratio:.2f}x" if ratio < 100 else f"{ratio:,.0f}x"
    if d["shuffle"] == "blocks":
        head = (f"groups of up to {size_text(d['group_bytes'])} (data.cache_bytes/2), "
                f"about {d['groups']} an epoch; ")
        if not remote:
            return head + "local files: nothing fetched"
        return head + f"fetch per epoch per node about {size_text(fetch)} ({times} the dataset)"
    if not remote:
        return "every window shuffled; local files: nothing fetched"
    if d["cache_share"] >= 1:
        return (f"data.cache_bytes ({size_text(d['cache_bytes'])}) holds the whole dataset: "
                f"each object fetched once per node ({size_text(remote)}), in the first epoch")
    return (f"refetches: the cache holds {d['cache_share']:.0%} of the dataset; fetch per "
            f"epoch per node about {size_text(fetch)} ({times} the dataset, an estimate); "
            "data.shuffle=blocks fetches it once an epoch")
