"""A TensorBoard event file, written without importing torch.utils.tensorboard.

torch's ``SummaryWriter`` imports TensorBoard's whole summary API and its TensorFlow
stub (about 0.4-0.6 s of CPU on the development machine, paid by rank 0 after the
other ranks are ready, so the first step waits for it), and builds one event per
scalar through numpy. What the trainer writes is a few kinds of events: scalars, a
text, the HParams summaries and the purge marker of a resumed run. They are built here
from TensorBoard's protocol buffers alone (``event_pb2``, ``summary_pb2``: tens of
milliseconds to import), all the scalars of a logging step in one event, and each
event is appended as a TFRecord (length, masked CRC-32C of the length, the data, masked
CRC-32C of the data: the format TensorBoard's reader checks,
https://www.tensorflow.org/tutorials/load_data/tfrecord#tfrecords_format_details).

Each call ends with a flush of the file: a viewer sees a logging step as soon as it
is written (torch's writer holds events up to 120 s in a thread of its own).
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

_POLY = 0x82F63B78  # CRC-32C (Castagnoli), reflected


def _table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ _POLY if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's mask: a CRC stored next to the data it covers is rotated and offset,
    so that the CRC of a record holding CRCs stays meaningful."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + \
        struct.pack("<I", masked_crc32c(data))


_files = itertools.count()  # two writers of one process in one second get two files


class EventWriter:
    """One TensorBoard run (a folder): an event file of its own, named as TensorBoard's
    writers name theirs. ``purge_step``: after a resume, events of this step and later
    in the folder's older files are hidden (the rerun's replace them)."""

    def __init__(self, folder: Path, purge_step: int | None = None):
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        self._event = Event
        folder.mkdir(parents=True, exist_ok=True)
        name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
                f"{os.getpid()}.{next(_files)}")
        self.path = folder / name
        self._file = self.path.open("ab")
        first = [Event(wall_time=time.time(), file_version="brain.Event:2")]
        if purge_step is not None:  # what TensorBoard reads as "restarted here"
            first += [Event(step=purge_step, wall_time=time.time(), file_version="brain.Event:2"),
                      Event(step=purge_step, wall_time=time.time(),
                            session_log=SessionLog(status=SessionLog.START))]
        self._write(first)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """All of ``values`` (tag -> number) at ``step``, as one event."""
        from tensorboard.compat.proto.summary_pb2 import Summary
        self.summary(Summary(value=[Summary.Value(tag=tag, simple_value=float(value))
                                    for tag, value in values.items()]), step)

    def text(self, tag: str, text: str, step: int) -> None:
        """A text in TensorBoard's Text tab (under ``tag/text_summary``, as torch's)."""
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
        from tensorboard.plugins.text.plugin_data_pb2 import TextPluginData
        meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(
            plugin_name="text", content=TextPluginData(version=0).SerializeToString()))
        tensor = TensorProto(dtype="DT_STRING", string_val=[text.encode()],
                             tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
        self.summary(Summary(value=[Summary.Value(tag=tag + "/text_summary", metadata=meta,
                                                  tensor=tensor)]), step)

    def summary(self, summary: Any, step: int | None = None) -> None:
        event = self._event(wall_time=time.time(), summary=summary)
        if step is not None:
            event.step = step
        self._write([event])

    def _write(self, events: list) -> None:
        self._file.write(b"".join(record(e.SerializeToString()) for e in events))
        self._file.flush()

    def close(self) -> None:
        self._file.close()
