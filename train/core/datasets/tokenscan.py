"""The largest token id of a local token file, scanned once per file and run.

Before any worker starts, the launcher checks that every id in a ``data.kind: tokens``
file is below ``data.vocab_size`` (a bad id found at step 5000 costs a job; found here
it is exit 2). That scan reads the whole file: about a CPU-second per GiB, more on a
loaded machine, and every worker's own check of the config did it again, on every
restart. So its result is kept in the run directory (``token-ids.json``), keyed by the
file's path and identified by its size, modification time and a hash of sampled chunks
(a file replaced by another of the same size and time, e.g. ``cp -p``, is scanned
again). The launcher scans before the run directory may exist, so what it found waits
in this process until :func:`record` writes it, once the launch holds the run
directory; the workers then find it there and skip the scan, and so does every later
launch of the same run. numpy is imported only when a file is scanned.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

from train.core.run import rundir

SAMPLES = 16                 # chunks hashed to tell two files of equal size and time apart
SAMPLE_BYTES = 64 << 10

# scanned in this process and not yet in a run directory: {path: entry}
_pending: dict[str, dict] = {}


def fingerprint(path: Path) -> dict:
    """Size, modification time and a hash of SAMPLES evenly spaced chunks."""
    st = path.stat()
    sha = hashlib.sha256(str(st.st_size).encode())
    with path.open("rb") as f:
        for k in range(SAMPLES):
            f.seek(k * max(0, st.st_size - SAMPLE_BYTES) // (SAMPLES - 1))
            sha.update(f.read(SAMPLE_BYTES))
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sampled_sha256": sha.hexdigest()}


def scan(path: Path) -> int:
    """The largest id in a uint16 token file (numpy's max over a memory map: measured
    4x less CPU than reading it in blocks, bench/tokenscan.py)."""
    import numpy as np
    return int(np.memmap(path, dtype=np.uint16, mode="r").max())


def _recorded(run_dir: Path | None) -> dict[str, dict]:
    if run_dir is None:
        return {}
    try:
        found = json.loads((run_dir / rundir.TOKEN_IDS).read_text())
    except (OSError, ValueError):  # none yet, or unreadable: scan again
        return {}
    return found if isinstance(found, dict) else {}


def largest(path: Path, run_dir: Path | None = None) -> int:
    """The largest id in ``path``: from this run's record when the file is unchanged,
    else scanned (and remembered for :func:`record`)."""
    name = str(path.resolve())
    now = fingerprint(path)
    for known in (_pending.get(name), _recorded(run_dir).get(name)):
        if isinstance(known, dict) and {k: known.get(k) for k in now} == now \
                and isinstance(known.get("largest"), int):
            return known["largest"]
    top = scan(path)
    _pending[name] = {**now, "largest": top}
    return top


def record(run_dir: Path) -> None:
    """Add what this process scanned to ``run_dir``'s record (replaced by rename, so a
    reader sees the old record or the new one). Best effort: without it the next start
    scans again."""
    if not _pending or not run_dir.is_dir():
        return
    merged = {**_recorded(run_dir), **_pending}
    tmp = run_dir / f".{rundir.TOKEN_IDS}.{os.getpid()}"
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, run_dir / rundir.TOKEN_IDS)
        _pending.clear()
