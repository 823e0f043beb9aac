"""Nothing lost: what a run writes, and what it reads again.

- no file of the run directory is written through a symbolic link (per file the run
  writes: the launcher refuses before starting, the write helpers refuse or replace);
- a damaged ``RUN_DIR/config.yaml`` is one warning, not a traceback.

Restarts within one launch, a full disk and a checkpoint folder turned read-only
mid-run: tests/e2e/test_run_files_runs.py.
"""

from __future__ import annotations

import pytest

from tests.harness.runs import (
    entry,
    tiny_run_config,
)
from train.core import files
from train.core.errors import ConfigError
from train.core.run import rundir

VICTIM_TEXT = "a file outside the run directory\n"


# ------------------------------------------------------------------ links

@pytest.mark.parametrize("name", rundir.RUN_FILES)
def test_no_run_file_is_written_through_a_link(tmp_path, name):
    """A link planted at any file name the run writes: exit 2 naming it, before anything
    is written; the file it points at is untouched."""
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM_TEXT)
    run_dir = tmp_path / "runs" / "run"
    (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
    (run_dir / name).symlink_to(victim)
    out = entry("train", str(tiny_run_config(tmp_path, max_steps=2)), cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"error: {run_dir}: {name}: is a symbolic link; the run writes no file through a "
        "link (it would overwrite what the link points at): remove it")
    assert victim.read_text() == VICTIM_TEXT
    assert sorted(p.name for p in run_dir.iterdir()) == sorted({name.split("/")[0]})


def test_the_write_helpers_never_write_through_a_link(tmp_path):
    """The same at the moment of writing (a link made after the launcher looked)."""
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM_TEXT)
    target = tmp_path / "config.yaml"
    target.symlink_to(victim)
    (tmp_path / "config.yaml.tmp").symlink_to(victim)  # its temporary name too
    files.write_atomic(target, "new: 1\n")
    assert not target.is_symlink() and target.read_text() == "new: 1\n"
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(files.LinkRefused, match=r"metrics\.jsonl is a symbolic link"):
        files.open_append(tmp_path / "metrics.jsonl")
    (tmp_path / "state.pt").symlink_to(victim)
    with files.create_new(tmp_path / "state.pt") as f:
        f.write(b"tensor bytes")
    assert victim.read_text() == VICTIM_TEXT
    from train.core.run import runlock
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ".lock").symlink_to(victim)
    with pytest.raises(ConfigError, match=r"\.lock: .* is a symbolic link"):
        runlock.acquire(tmp_path / "run")
    assert victim.read_text() == VICTIM_TEXT


def test_a_damaged_run_config_is_one_warning_not_a_traceback(tmp_path):
    config = tiny_run_config(tmp_path, max_steps=2)
    assert entry("train", str(config), cwd=tmp_path).returncode == 0
    recorded = tmp_path / "runs" / "run" / "config.yaml"
    recorded.write_bytes(recorded.read_bytes()[:40] + b"\xff\xfe" + recorded.read_bytes()[40:])
    again = entry("train", str(config), "train.max_steps=4", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Traceback" not in again.stderr
    warnings = [ln for ln in again.stderr.splitlines() if "config.yaml: not UTF-8" in ln]
    assert len(warnings) == 1 and "this start rewrites it" in warnings[0]
    recorded.read_text(encoding="utf-8")  # rewritten whole
