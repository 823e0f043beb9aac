"""Reads the records of a W&B run file (``run-<id>.wandb``), for the trackers' tests.

wandb 0.31 writes the file from its Go core and ships no Python reader any more. The
format is LevelDB's log format with a W&B header: 7 bytes (``:W&B``, magic 0xBEE1
little-endian, version 0), then 32 KiB blocks of chunks, each with a 7-byte header
(CRC-32C, length as little-endian uint16, type: 1 whole, 2 first, 3 middle, 4 last);
a block's tail shorter than a header is zero padding. The payloads are the
``wandb_internal.proto`` ``Record`` messages that ship with wandb's Python package.
Reference: https://github.com/google/leveldb/blob/main/doc/log_format.md and wandb's
core/pkg/leveldb/.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

BLOCK = 32 * 1024
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator:
    from wandb.proto import wandb_internal_pb2
    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0), data[:7]
    pos, payload = 7, b""
    while pos + CHUNK_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + CHUNK_HEADER])
        if kind == 0:  # a preallocated, unwritten tail
            break
        payload += data[pos + CHUNK_HEADER:pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            payload = b""
            yield record


def history(path: Path) -> dict[int, dict]:
    """{step: {key: value}} of the run's logged rows (W&B's own _-keys left out)."""
    rows: dict[int, dict] = {}
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in record.history.item}
            row = rows.setdefault(int(items["_step"]), {})
            row.update({k: v for k, v in items.items() if not k.startswith("_")})
    return rows


def run_info(path: Path) -> dict:
    """The run record's id, name and config, and the exit code (None if it never ended)."""
    info: dict = {"exit_code": None}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            info.update(id=record.run.run_id, name=record.run.display_name,
                        config={i.key: json.loads(i.value_json)
                                for i in record.run.config.update})
        elif kind == "exit":
            info["exit_code"] = record.exit.exit_code
    return info
