"""Sharded checkpoints: each rank writes its own shards of the model and optimizer state
with torch.distributed.checkpoint (DCP), so that no rank ever holds the full state.

The shards go into ``step-N.partial/model/`` (``rundir.SHARDS``: ``__<rank>_0.distcp``
per rank, its own shards, ``__<rank>_1.distcp`` beside it under FSDP for the small values
every rank reads, and the ``.metadata`` index rank 0 writes) under the same protocol as
everything else (:mod:`.store`): each rank fsyncs and hashes its own files, rank 0 lists
every hash in ``checksums.json`` and renames the folder into place. DCP writes its files through
:class:`_BulkFileSystem`: the same pipeline as every other checkpoint file
(:class:`train.core.bulk.BulkFile`: large writes, O_DIRECT where it pays, hashed while
written), so no file is read back to be hashed. The rest of the checkpoint (step,
data position, scheduler, config) stays in ``state.pt``, the RNG in ``rank-<r>.pt``.

Loading reshards: DCP reads, for each rank, the pieces of the saved shards that its own
shards (or full tensors, for DDP and one process) cover, so a checkpoint saved at one
world size resumes at another, and under another strategy. See
https://pytorch.org/docs/stable/distributed.checkpoint.html.
"""

from __future__ import annotations

import contextlib
import os
import queue
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from train.checkpoint.serializer import without_zip_crc
from train.core.bulk import BulkFile
from train.core.files import fsync_dir

MODEL_PREFIX = "model."


def _writer(folder: Path):
    """DCP's file writer into ``folder``, its files written by :class:`_BulkFileSystem`
    (which fsyncs each one: DCP's own fsync is off)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystem

    class _BulkFileSystem(FileSystem):
        """Files written through BulkFile; ``digests``: path -> SHA-256 of each one."""

        def __init__(self):
            super().__init__()
            self.digests: dict[Path, str] = {}

        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator:
            if "w" not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            with without_zip_crc(), BulkFile(Path(path)) as stream:
                yield stream  # DCP torch.saves each tensor into it
            self.digests[Path(path)] = stream.digest

        def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
            super().rename(path, new_path)  # the index: written as a temporary, renamed
            if Path(path) in self.digests:
                self.digests[Path(new_path)] = self.digests.pop(Path(path))

    class _SplitWriter(dcp.FileSystemWriter):
        """Two files per rank: ``__<rank>_0.distcp``, this rank's own shards, and
        ``__<rank>_1.distcp``, the values DCP has this rank write for every rank
        (replicated tensors such as the optimizer's step counts, and non-tensor state,
        spread over the ranks); one, ``__<rank>_0.distcp``, where it has only one kind
        (no shards: DDP, one process). A rank that loads with the same world size and strategy
        then reads its own shard file and the small ones: a node resuming from object
        storage fetches only those (:mod:`.fetcher`), not every rank's shards."""

        def write_data(self, plan, planner):
            from torch.distributed.checkpoint.planner import WriteItemType
            own = [i for i in plan.items if i.type == WriteItemType.SHARD]
            shared = [i for i in plan.items if i.type != WriteItemType.SHARD]
            files: queue.Queue = queue.Queue()
            for number, items in enumerate(b for b in (own, shared) if b):
                name = f"{plan.storage_data.prefix}{number}.distcp"
                files.put((self.fs.concat_path(self.path, name), name, items))
            return self._write_data(planner, files)

    writer = _SplitWriter(str(folder), sync_files=False, single_file_per_rank=True)
    writer.fs = _BulkFileSystem()
    return writer


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(full_state_dict=False)


def state_dicts(model, optimizer) -> dict[str, Any]:
    """This rank's shards (its local pieces under FSDP, full tensors otherwise)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from train.distributed.parallel import state_target
    model_state, optim_state = get_state_dict(state_target(model), optimizer, options=_options())
    return {"model": model_state, "optimizer": optim_state}


def save(state: dict[str, Any], folder: Path) -> dict[Path, str]:
    """Collective: every rank writes its shards into ``folder``, fsync'ed; the files this
    rank wrote (rank 0's include the index), each with its SHA-256."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    writer = _writer(folder)
    try:
        with _one_process():
            dcp.save(state, storage_writer=writer, no_dist=not dist.is_initialized())
    except CheckpointException as exc:  # every rank gets every rank's failures
        raise first_failure(exc) from None
    return _written(folder, writer.fs.digests)


def save_in_background(state: dict[str, Any], folder: Path
                       ) -> Callable[[], dict[Path, str]]:
    """Collective: copies this rank's shards to CPU memory (DCP's staging) and returns;
    DCP's thread writes them, coordinating the ranks over a process group of its own
    (the training thread keeps the default one). The returned function waits for the
    writes and returns what :func:`save` returns (or raises the write's error)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    writer = _writer(folder)
    with _one_process():
        future = dcp.async_save(state, storage_writer=writer, process_group=writer_group(),
                                async_stager=_staging(), no_dist=not dist.is_initialized())

    def finish() -> dict[Path, str]:
        try:
            with _one_process():
                future.result()
        except CheckpointException as exc:
            raise first_failure(exc) from None
        return _written(folder, writer.fs.digests)
    return finish


_GROUP: list = []  # the background writes' process group, made once per process
_STAGING: list = []  # the background writes' staging area, made once per process


def _staging():
    """Where a background save copies this rank's shards before training goes on: one
    CPU copy kept from save to save (while the shards keep their shapes), so that only the
    first background save pays for new memory (on a busy VM, touching fresh memory cost
    more than the copy itself: 4 of the 5 s a 400 MB copy blocked). A save waits for
    the previous one's write before it copies (:mod:`.store`), so the copy is never
    overwritten while being written."""
    import torch
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    class _KeptStaging(BlockingAsyncStager):
        def __init__(self):
            super().__init__(cache_staged_state_dict=True)
            self.layout = None

        def stage(self, state_dict):
            layout = _layout(state_dict)
            if layout != self.layout:  # new shapes (the optimizer's state appeared)
                self.state_dict_cache, self.layout = None, layout
            if self.state_dict_cache is None:
                self.state_dict_cache = _create_cpu_state_dict(
                    state_dict, pin_memory=torch.cuda.is_available())
            return _copy_state_dict(state_dict, self.state_dict_cache)

    if not _STAGING:
        _STAGING.append(_KeptStaging())
    return _STAGING[0]


def _layout(state: Any) -> Any:
    """The structure of a state dict: keys, and each tensor's shape and dtype."""
    import torch
    if isinstance(state, torch.Tensor):
        local = getattr(state, "_local_tensor", state)
        return (tuple(state.shape), tuple(local.shape), state.dtype)
    if isinstance(state, dict):
        return tuple((key, _layout(value)) for key, value in state.items())
    if isinstance(state, (list, tuple)):
        return tuple(_layout(value) for value in state)
    return type(state).__name__


def writer_group():
    """A gloo group for DCP's thread (async save needs a CPU backend, also under NCCL);
    created at the first background save, which every rank reaches at the same step,
    with the run's collective timeout (distributed.timeout_s)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return None
    if not _GROUP:
        _GROUP.append(dist.new_group(backend="gloo", timeout=_run_timeout()))
    return _GROUP[0]


def _run_timeout():
    """The default group's timeout: new_group's own default is torch's 30 minutes,
    whatever the run set. None (torch's default) where this torch does not say."""
    import torch
    import torch.distributed as dist
    for device in ("cpu", "cuda"):
        try:
            return dist.group.WORLD._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):  # no backend for that device (torch 2.13
            # raises RuntimeError), or a torch whose private internals differ: not said here
            continue
    return None


def _written(folder: Path, digests: dict[Path, str]) -> dict[Path, str]:
    """The files this rank wrote (rank 0's include the index), with their hashes; their
    names in ``folder`` made durable too (the index is renamed into place)."""
    fsync_dir(folder)
    return dict(sorted(digests.items()))


def first_failure(exc: BaseException) -> BaseException:
    """The error under DCP's CheckpointException (which is a BaseException): the lowest
    failing rank's, e.g. the OSError of a full disk, so that it reads as any failed
    write."""
    failures = getattr(exc, "failures", {}) or {}
    for rank in sorted(failures):
        inner = failures[rank]
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, Exception):
            return inner
    return RuntimeError(str(exc))


def load(model, optimizer, folder: Path) -> None:
    """Collective: every rank reads what its shards need from a sharded checkpoint,
    whatever world size and strategy it was saved with."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from train.distributed.parallel import state_target
    state = state_dicts(model, optimizer)
    with _one_process():
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(folder)),
                 no_dist=not dist.is_initialized())
    set_state_dict(state_target(model), optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"], options=_options())


def files_read(model, optimizer, folder: Path) -> set[str]:
    """The files of the sharded checkpoint ``folder`` that :func:`load` reads on this
    rank, from its index (``.metadata``) alone: DCP's own load plan for this rank's
    shards, each piece it reads mapped to the file that holds it. With the world size
    and strategy it was saved with, a rank's own file (and any file DCP put a replicated
    value in); resharded, the files its new shards overlap."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state_dicts(model, optimizer), metadata, is_coordinator=False)
    return {metadata.storage_data[item.storage_index].relative_path
            for item in planner.create_local_plan().items}


def full_model_state(folder: Path) -> dict[str, Any]:
    """The model's full tensors from a sharded checkpoint, in this process alone (no
    process group): what export consolidates."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    reader = dcp.FileSystemReader(str(folder))
    meta = reader.read_metadata().state_dict_metadata
    model = {key.removeprefix(MODEL_PREFIX): torch.empty(tuple(m.size),
                                                          dtype=m.properties.dtype)
             for key, m in meta.items()
             if key.startswith(MODEL_PREFIX) and isinstance(m, TensorStorageMetadata)}
    state = {"model": model}
    with _one_process():
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state["model"]


@contextlib.contextmanager
def _one_process():
    """DCP warns that it "assumes the intent" when no process group runs: it is ours."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to",
                                category=UserWarning)
        yield
