"""The files behind each ``data.kind``, read and checked the same way by the launcher
(before any worker starts) and by the worker (:mod:`train.data.builders`). numpy and torch
are imported only when a file of theirs is checked.

Checks are cheap: headers and sizes, labels (small), never the bulk of a large file
(``.npy`` features and ``.pt`` tensors are memory-mapped). A problem is one
:class:`~train.core.errors.ConfigError` naming the data file and the key that points to it
(exit 2), so a bad file costs a second, not a worker start and a traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from train.core.errors import ConfigError
from train.core.files import describe_load_error as load_error

if TYPE_CHECKING:
    import numpy as np

# Not part of a text corpus even when the glob matches: installed packages, caches.
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def is_text_folder(path: str | list[str] | None) -> bool:
    """Whether ``data.kind: text`` reads a folder (with ``data.text_glob``; None: the
    standard library's source) rather than the files and objects ``data.path`` names."""
    return path is None or (isinstance(path, str) and not path.startswith("s3://")
                            and Path(path).is_dir())


def text_files(root: Path, glob: str) -> list[Path]:
    """The files of a text corpus, in the order they are read."""
    return sorted(p for p in root.glob(glob)
                  if p.is_file() and not SKIP_DIRS & set(p.relative_to(root).parts))


def check_text(root: Path, glob: str, max_bytes: int, context_length: int) -> None:
    """At least two training windows of text must be there to read."""
    files = text_files(root, glob)
    if not files:
        raise ConfigError(str(root), "data.text_glob", f"no file matches {glob!r} under "
                                                       f"{root}; point data.path at a folder "
                                                       "of text files or change data.text_glob")
    need, sizes = 2 * context_length + 1, []
    for f in files:  # stat only as many as it takes
        sizes.append(f.stat().st_size)
        if sum(sizes) >= need or (max_bytes and sum(sizes) >= max_bytes):
            break
    enough_text(str(root), sizes, max_bytes, context_length)


def enough_text(source: str, sizes: list[int], max_bytes: int, context_length: int) -> None:
    """Files of these sizes hold at least two training windows of text, read up to
    ``max_bytes`` (0: all)."""
    need, total = 2 * context_length + 1, sum(sizes)
    total = min(total, max_bytes) if max_bytes else total
    if total < need:
        raise ConfigError(source, "data.path", f"{total} bytes of text in {len(sizes)} "
                                               f"file(s); need at least {need} for "
                                               f"model.context_length={context_length}")


def load_npy(path: Path, key: str, *, mmap: bool) -> np.ndarray:
    """A numeric array (no pickled objects); mmap: map instead of reading it."""
    import numpy as np  # only when a .npy file is checked: the core stays numpy-free
    try:
        array = np.load(path, allow_pickle=False, mmap_mode="r" if mmap else None)
    except (ValueError, OSError, EOFError) as exc:  # corrupt, truncated, or object arrays
        raise ConfigError(str(path), key, f"not a readable numeric .npy: "
                                          f"{' '.join(str(exc).split())}") from None
    if array.dtype.kind not in "biuf":
        raise ConfigError(str(path), key, f"dtype {array.dtype} is not numeric")
    return array


def load_pt(path: Path, *, mmap: bool) -> tuple[Any, Any]:
    """(features, labels) from a .pt file holding exactly those tensors, loaded with
    ``weights_only=True`` (nothing but tensors and plain containers is ever built)."""
    import torch
    try:
        blob = torch.load(path, weights_only=True, map_location="cpu", mmap=mmap)
    except Exception as exc:  # a corrupt file, or pickled objects: bad input, never code
        raise ConfigError(str(path), "data.path", f"cannot load: {load_error(exc)}") from None
    if not isinstance(blob, dict) or not {"features", "labels"} <= set(blob) \
            or not all(isinstance(blob[k], torch.Tensor) for k in ("features", "labels")):
        raise ConfigError(str(path), "data.path", "a .pt file must hold a dict with tensors "
                                                  "'features' and 'labels'")
    return blob["features"], blob["labels"]


def check_labels(features_shape: tuple[int, ...], labels: Any, source: str, key: str) -> None:
    """N samples and N non-negative integer class labels."""
    import numpy as np
    labels = np.asarray(labels)
    n = features_shape[0] if features_shape else 0
    if labels.ndim != 1 or labels.dtype.kind not in "iub" or len(labels) != n:
        raise ConfigError(source, key, f"need N features and N integer labels, got "
                                       f"{tuple(features_shape)} and {labels.shape} "
                                       f"{labels.dtype}")
    if n < 2:
        raise ConfigError(source, key, f"{n} sample(s); need at least 2")
    low = int(labels.min())
    if low < 0:
        raise ConfigError(source, key, f"label {low} is negative; class labels are "
                                       "0..num_classes-1")


def check_tensors(path: Path, labels_path: str | None) -> None:
    """The parent's check of ``data.kind: tensors`` (features are never read)."""
    if path.suffix == ".pt":
        x, y = load_pt(path, mmap=True)
        check_labels(tuple(x.shape), y.numpy(), str(path), "data.path")
        return
    x = load_npy(path, "data.path", mmap=True)
    y = load_npy(Path(labels_path), "data.labels_path", mmap=False)
    check_labels(x.shape, y, str(labels_path), "data.labels_path")
