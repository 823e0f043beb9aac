"""The trainer's TensorBoard event files (train/observe/events.py), read back by
TensorBoard's own reader: every record's checksum, the scalars of a logging step, the
text tab, and a resumed run's events replacing those past its checkpoint."""

from __future__ import annotations

import math

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

from train.observe import events
from train.observe.board import Board


def reader(folder):
    acc = EventAccumulator(str(folder), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    return acc


def test_checksums_are_tensorboards():
    for data in (b"", b"a", b"123456789", bytes(range(256)) * 3):
        assert events.masked_crc32c(data) == masked_crc32c(data), data
    assert events.crc32c(b"123456789") == 0xE3069283  # CRC-32C's check value


def test_a_resumed_run_replaces_the_steps_after_its_checkpoint(tmp_path):
    first = Board(tmp_path, 0, "seed: 0")
    for step in range(1, 31):
        first.log_train(step, {"loss": 1.0 / step, "lr": 0.5, "grad_norm": 2})
    first.note(30, "stragglers", "rank 1 is slow")
    first.close()
    resumed = Board(tmp_path, 20, "seed: 0")  # the checkpoint of step 20
    for step in range(21, 26):
        resumed.log_train(step, {"loss": 100.0 + step, "lr": 0.25})
    resumed.close()
    run = reader(tmp_path / "train")
    loss = {e.step: e.value for e in run.Scalars("loss")}
    assert sorted(loss) == list(range(1, 26))
    assert math.isclose(loss[20], 1.0 / 20, rel_tol=1e-6) and loss[21] == 121.0  # float32
    assert [e.step for e in run.Scalars("optim/grad_norm")] == list(range(1, 21))
    assert {"config/text_summary", "stragglers/text_summary"} <= set(run.Tags()["tensors"])
    assert run.Tensors("stragglers/text_summary")[0].tensor_proto.string_val == [
        b"rank 1 is slow"]
