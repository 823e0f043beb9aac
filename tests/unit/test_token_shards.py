"""``data.kind: tokens`` over several files: one sequence of windows that never cross a
file, read in the one global order (world size and resume do not change it), the
launcher's checks of the files (one line each, exit 2), and the token-id scan kept in
the run directory so that a restart skips it; a resume onto files that changed is bad
input unless data.allow_changed says otherwise. Files in object storage against a real
S3 server: tests/unit/test_token_objects.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.harness.checkpoints import rewind
from tests.harness.runs import TINY_GPT, last_line, losses, merge, run_train, write_config
from train.core.config import load_config
from train.core.datasets import tokenscan
from train.core.datasets.tokenfiles import resolve
from train.core.errors import EXIT_BAD_INPUT, BadData, ConfigError
from train.core.run import rundir
from train.data.builders import build_data
from train.data.order import GlobalOrder, RankBatchSampler
from train.data.tokenshards import ShardedWindows, Shards

LENGTH = TINY_GPT["model"]["context_length"]


def token_files(folder: Path, sizes=(1000, 37, 2001, 600), vocab: int = 1000) -> list[Path]:
    """Files of distinct ids (file k's tokens start at k*10000 mod vocab, then count up)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, n in enumerate(sizes):
        path = folder / f"part-{k:02d}.bin"
        ((np.arange(n) + 7919 * k) % vocab).astype(np.uint16).tofile(path)
        paths.append(path)
    return paths


def config(tmp_path: Path, path, **data):
    tree = merge(TINY_GPT, {"output": {"dir": str(tmp_path / "runs")},
                            "data": {"kind": "tokens", "path": path, "vocab_size": 1000,
                                     **data}})
    return load_config(write_config(tmp_path / "c.yaml", tree))


def windows(dataset) -> list[list[int]]:
    x, y = dataset.__getitems__(list(range(len(dataset))))
    assert torch.equal(x[:, 1:], y[:, :-1])
    return torch.cat([x, y[:, -1:]], dim=1).tolist()


def expected_windows(paths: list[Path]) -> list[list[int]]:
    """Each file cut on its own, as one file always was, the files one after another."""
    out = []
    for p in paths:
        t = np.fromfile(p, dtype=np.uint16).astype(int).tolist()
        out += [t[j * LENGTH: j * LENGTH + LENGTH + 1] for j in range((len(t) - 1) // LENGTH)]
    return out


def test_several_files_are_one_sequence_of_windows_that_never_cross_a_file(tmp_path):
    paths = token_files(tmp_path / "data")
    data = build_data(config(tmp_path, str(tmp_path / "data" / "*.bin")))
    assert windows(data.train) + windows(data.val) == expected_windows(paths)
    assert len(data.val) == int((len(data.train) + len(data.val)) * 0.05)  # the tail
    listed = build_data(config(tmp_path, [str(p) for p in paths]))
    assert windows(listed.train) == windows(data.train) and listed.data_hash == data.data_hash


def test_one_file_reads_exactly_as_before_and_as_a_list_of_one(tmp_path):
    (path,) = token_files(tmp_path / "data", sizes=(3001,))
    single = build_data(config(tmp_path, str(path)))
    assert type(single.train).__name__ == "WindowDataset"  # the path it always took
    assert windows(single.train) + windows(single.val) == expected_windows([path])
    assert windows(build_data(config(tmp_path, [str(path)])).train) == windows(single.train)
    # the several-files reader cuts one file into the same windows
    from train.core.datasets.tokenfiles import resolve
    from train.data.builders import sharded_tokens
    cfg = config(tmp_path, str(path))
    sharded = sharded_tokens(cfg, resolve(cfg.data.path, "c.yaml"), "c.yaml")
    assert windows(sharded.train) == windows(single.train)


def rank_batches(dataset, world: int, start: int, end: int, g: int = 8) -> list[list[int]]:
    """Per step, the token windows all ranks read, rank after rank."""
    order = GlobalOrder(len(dataset), seed=3)
    per_rank = []
    for r in range(world):
        sampler = RankBatchSampler(order, global_batch_size=g, rank=r, world_size=world,
                                   micro_batch_size=2, start_step=start, end_step=end)
        micro = [dataset.__getitems__(b)[0].tolist() for b in sampler]
        per_step = g // world // 2
        per_rank.append([[w for m in micro[s * per_step:(s + 1) * per_step] for w in m]
                         for s in range(end - start)])
    return [[w for r in range(world) for w in per_rank[r][s]] for s in range(end - start)]


def test_the_order_over_files_is_the_same_for_any_world_size_and_resume_point(tmp_path):
    token_files(tmp_path / "data")
    train = build_data(config(tmp_path, str(tmp_path / "data" / "*.bin"))).train
    whole = rank_batches(train, 1, 0, 30)  # more than an epoch
    assert rank_batches(train, 2, 0, 30) == whole == rank_batches(train, 4, 0, 30)
    assert rank_batches(train, 2, 13, 30) == whole[13:]


def bad(tmp_path: Path, path, **data) -> str:
    with pytest.raises(ConfigError) as caught:
        config(tmp_path, path, **data)
    line = caught.value.one_line()
    assert "\n" not in line
    return line


def test_files_that_cannot_be_a_dataset_are_one_line_naming_them(tmp_path):
    paths = token_files(tmp_path / "data")
    assert "data.path: " in bad(tmp_path, str(tmp_path / "none" / "*.bin")) and \
        "no file matches" in bad(tmp_path, str(tmp_path / "none" / "*.bin"))
    assert "no such file" in bad(tmp_path, [str(paths[0]), str(tmp_path / "gone.bin")])
    assert "listed twice" in bad(tmp_path, [str(paths[0]), str(paths[0])])
    (tmp_path / "data" / "odd.bin").write_bytes(b"\0" * 7)
    assert "odd.bin: not a uint16 token file" in bad(tmp_path, str(tmp_path / "data" / "*"))
    (tmp_path / "data" / "odd.bin").unlink()
    line = bad(tmp_path, str(tmp_path / "data" / "*.bin"), vocab_size=900)
    assert "data.vocab_size" in line and "part-00.bin" in line and "at least 1000" in line
    with pytest.raises(ConfigError) as caught:  # with the gpt's own complaint about tensors
        config(tmp_path, [str(paths[0])], kind="tensors")
    assert "data.path: a list of files is for data.kind=tokens" in str(caught.value)


def test_the_scan_is_kept_in_the_run_directory_and_used_while_the_file_is_unchanged(
        tmp_path, monkeypatch):
    (path,) = token_files(tmp_path / "data", sizes=(5000,))
    tokenscan._pending.clear()
    config(tmp_path, str(path))  # scanned: fine, and remembered in this process
    run_dir = tmp_path / "runs" / "c"
    run_dir.mkdir(parents=True)
    tokenscan.record(run_dir)
    record = json.loads((run_dir / rundir.TOKEN_IDS).read_text())
    entry = record[str(path.resolve())]
    assert entry["largest"] == 999 and entry["size"] == 10000 and not tokenscan._pending
    # the record is what a start believes while the file is the same: a record claiming a
    # larger id makes the check fail without reading the file
    entry["largest"] = 4000
    (run_dir / rundir.TOKEN_IDS).write_text(json.dumps(record))
    assert "holds token id 4000" in bad(tmp_path, str(path))
    # the same size and time but other bytes (cp -p of another file): scanned again
    st = path.stat()
    ((np.arange(5000) * 3) % 1000).astype(np.uint16).tofile(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    config(tmp_path, str(path))
    # a file larger than the scan limit is left to the batch-by-batch check
    from train.core.config import kinds
    tokenscan._pending.clear()
    monkeypatch.setattr(kinds, "TOKEN_SCAN_LIMIT", 1000)
    config(tmp_path, str(path), vocab_size=500)
    assert not tokenscan._pending


def test_the_scan_finds_the_largest_id_anywhere(tmp_path):
    for at in (0, 7777, 9999):
        ids = np.full(10_000, 5, dtype=np.uint16)
        ids[at] = 65_535 - at // 1000
        ids.tofile(tmp_path / "t.bin")
        assert tokenscan.scan(tmp_path / "t.bin") == 65_535 - at // 1000


def test_an_id_outside_the_vocabulary_found_by_a_loader_worker_is_one_line(tmp_path):
    """An object is checked batch by batch (no scan before it is fetched): the error
    raised in a DataLoader worker process reaches the rank as the one line it was."""
    paths = token_files(tmp_path / "data", sizes=(400, 400))
    files = resolve([str(p) for p in paths], "c.yaml")
    data = ShardedWindows(Shards(files, None), LENGTH, 0, 40, vocab_size=900)
    loader = torch.utils.data.DataLoader(data, batch_size=40, num_workers=1,
                                         collate_fn=lambda batch: batch)
    with pytest.raises(BadData) as caught:
        next(iter(loader))
    line = caught.value.one_line()
    assert "\n" not in line and caught.value.exit_code == EXIT_BAD_INPUT
    assert line.startswith("error: ") and "part-0" in line and ">= data.vocab_size=900" in line
    assert "Traceback" not in line and "DataLoader" not in line


def test_a_resume_onto_changed_files_is_bad_input_unless_allowed(tmp_path):
    """A restart never trains on other data than its checkpoint did without being told."""
    paths = token_files(tmp_path / "data", sizes=(3000, 2500), vocab=256)
    config_file = write_config(tmp_path / "c.yaml", merge(TINY_GPT, {
        "output": {"dir": str(tmp_path / "runs")},
        "data": {"kind": "tokens", "vocab_size": 256, "path": str(tmp_path / "data" / "*.bin")},
        "train": {"max_steps": 4}, "checkpoint": {"every_steps": 2}}))
    proc = run_train(config_file)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "c"
    trained = losses(run_dir)
    rewind(run_dir, 2)
    ((np.arange(2500) * 3) % 256).astype(np.uint16).tofile(paths[1])  # same size, other ids
    proc = run_train(config_file)
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr[-3000:]
    line = last_line(proc.stderr)
    assert line.startswith("error: ") and "data.path: differs from the data" in line
    assert "data.allow_changed=true" in line and "Traceback" not in proc.stderr
    assert losses(run_dir) == trained  # nothing trained on the other data
    proc = run_train(config_file, "data.allow_changed=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming on other data than the checkpoint trained on" in proc.stderr
    assert sorted(losses(run_dir)) == [1, 2, 3, 4] and losses(run_dir) != trained

