"""The launcher <-> worker protocol (train/core/run/protocol.py): typed reports that survive
the round trip through their files, the one retry rule, and the decisions a restarted
worker takes from what earlier attempts left (a real ``python -m train.worker``)."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys

import pytest

from launcher.endings.outcome import RULES, Ending, classify
from tests.harness.runs import ROOT, clean_env, limit
from train.core.errors import EXIT_CODES, FINAL_EXIT_CODES
from train.core.run import protocol
from train.core.run.identity import STATUS_DIR_VAR, WorkerIdentity
from train.core.run.protocol import Failure, Probe, Report, Reporter


def reporter(folder, rank=0, restart=0) -> Reporter:
    return Reporter(WorkerIdentity(rank=rank, local_rank=rank, restart_count=restart,
                                   status_dir=str(folder)))


def test_a_report_reads_back_as_written_with_its_typed_parts(tmp_path):
    first = Failure(restart=0, rank=1, error="ValueError: 3", checkpoint="step-4",
                    hung="own", log_dir="/logs/1")
    written = reporter(tmp_path, rank=1, restart=2).ended(1, "ValueError: 3", repeated=first)
    probe = Probe(world_size=2, ok=True, seconds=0.5, bytes=4096, bus_gb_s=None)
    Reporter(WorkerIdentity(rank=3, status_dir=str(tmp_path)), protocol.COMM).stage(
        "done", probe=probe)
    (read,) = protocol.read_all(tmp_path)
    assert read == written and isinstance(read.repeated, Failure) and read.repeated == first
    (comm,) = protocol.read_all(tmp_path, kind=protocol.COMM)
    assert comm.probe == probe and comm.rank == 3 and comm.stage == "done"


def test_the_retry_rule_is_final_for_exactly_bad_input_cannot_run_and_divergence():
    assert sorted(c for c in EXIT_CODES if not protocol.restart_can_help(c)) == \
        sorted(FINAL_EXIT_CODES) == [2, 3, 4]
    assert not any(protocol.restart_can_help(c, repeated=True) for c in EXIT_CODES)


def test_an_ending_names_the_checkpoint_the_run_stood_at(tmp_path):
    checkpoints = tmp_path / "run" / "checkpoints"
    (checkpoints / "step-6").mkdir(parents=True)
    (checkpoints / "latest").write_text("step-6\n")
    r = reporter(tmp_path / "status")
    (tmp_path / "status").mkdir()
    assert r.ended(1, "boom").checkpoint is None  # the config was not loaded yet
    r.checkpoints = checkpoints
    assert r.ended(1, "boom").checkpoint == "step-6"
    assert [f.checkpoint for f in protocol.failures(tmp_path / "status")] == [None, "step-6"]


def test_a_failure_that_repeats_from_the_same_checkpoint_is_found_and_a_hang_comes_first(
        tmp_path):
    for restart in (0, 1):
        reporter(tmp_path, rank=0, restart=restart).ended(1, f"timed out after {restart} s")
        hang = Reporter(WorkerIdentity(rank=1, local_rank=1, restart_count=restart,
                                       status_dir=str(tmp_path)))
        hang.hung(step=7, waits=protocol.STUCK_IN_OWN_CODE, error="no progress at x.py:3")
    again = reporter(tmp_path, restart=2).repeated_failure()
    assert again is not None and again.rank == 1 and again.culprit
    assert reporter(tmp_path, restart=1).repeated_failure() is None  # one failure is no pattern


def test_a_failure_from_a_newer_checkpoint_is_not_a_repeat(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    for restart, step in ((0, 2), (1, 4)):
        (checkpoints / f"step-{step}").mkdir(parents=True)
        (checkpoints / "latest").write_text(f"step-{step}\n")
        r = reporter(tmp_path, restart=restart)
        r.checkpoints = checkpoints
        r.ended(1, "RuntimeError: flaky")
    assert reporter(tmp_path, restart=2).repeated_failure() is None


def test_an_earlier_final_ending_is_found_only_for_a_restart(tmp_path):
    reporter(tmp_path, rank=0).ended(1, "RuntimeError: x")
    assert reporter(tmp_path, restart=1).earlier_final() is None
    reporter(tmp_path, rank=1).ended(3, "error: no GPU")
    assert reporter(tmp_path, restart=1).earlier_final().exit_code == 3
    assert reporter(tmp_path, restart=0).earlier_final() is None


def test_a_restarted_worker_refuses_to_train_after_a_final_ending(tmp_path):
    """The real worker entry: it reads the earlier round's report and ends at once with
    its code, before importing torch or reading a config."""
    reporter(tmp_path, rank=1).ended(4, "error: training diverged at step 9")
    env = clean_env(PYTHONPATH=str(ROOT), **{STATUS_DIR_VAR: str(tmp_path)},
                    TORCHELASTIC_RESTART_COUNT="1", RANK="0", WORLD_SIZE="2")
    out = subprocess.run([sys.executable, "-m", "train.worker", "no-such-config.yaml"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit(120))
    assert out.returncode == 4, out.stderr
    assert "rank 0: not restarting: rank 1 ended with exit 4" in out.stderr
    mine = [r for r in protocol.read_all(tmp_path) if r.rank == 0]
    assert [(r.exit_code, r.restart) for r in mine] == [(4, 1)]


# ------------------------------------------------------------------ the outcome rules

def _ended(rank, code, error=None, **fields) -> Report:
    return Report(rank=rank, local_rank=rank, exit_code=code, error=error, **fields)


ENDINGS = {  # rule name -> (rc, reports, signals, expected, mode[, torchrun's exits])
    "final": (1, [_ended(0, 3, "error: no GPU")], [], 1, "torchrun"),
    "repeated": (1, [_ended(0, 1, "x", repeated=Failure(0, 1, "x"))], [], 1, "torchrun"),
    "died first": (1, [_ended(0, 1, "Connection reset by peer [127.0.0.1]:5")], [], 2,
                   "torchrun", [protocol.Exit(1, 1, -9, first=True)]),
    "hang": (1, [_ended(0, 1, "timed out"), _ended(1, 1, "no progress", hung="loader")], [],
             2, "torchrun"),
    "failed": (1, [_ended(0, 1, "ValueError")], [], 1, "torchrun"),
    "store lost": (75, [_ended(0, 143)], [], 1, "torchrun"),
    "only local": (0, [_ended(0, 0, only_local="error: ... step-4 is only on this disk"),
                       _ended(1, 0)], [], 2, "torchrun"),
    "signal after the last step": (0, [_ended(0, 0)], [signal.SIGTERM], 1, "direct"),
    "stopped": (1, [_ended(0, 143)], [signal.SIGTERM], 1, "torchrun"),
    "done": (0, [_ended(0, 0)], [], 1, "torchrun"),
    "died": (-9, [], [], 1, "direct"),
    "reports missing": (1, [_ended(0, 0)], [], 2, "torchrun"),
}


@pytest.mark.parametrize("name", [rule.name for rule in RULES])
def test_every_outcome_rule_is_the_first_to_hold_for_some_ending(name):
    """No rule is shadowed by the ones above it: each decides an ending of its own."""
    rc, found, signals, expected, mode, *exits = ENDINGS[name]
    exits = exits[0] if exits else []
    ending = Ending.of(rc, found, signals, expected, mode, "train", exits)
    first = next(rule for rule in RULES if rule.when(ending))
    assert first.name == name
    assert classify(rc, found, signals, expected, mode, exits=exits) == first.then(ending)


def test_the_store_lost_code_is_torchruns():
    from launcher.running.agent_contract import STORE_LOST
    assert ENDINGS["store lost"][0] == STORE_LOST


def test_a_report_has_no_free_form_fields():
    """The protocol is typed: every field a launcher reads is named (no dict of extras)."""
    assert not [f.name for f in dataclasses.fields(Report) if "dict" in str(f.type) or
                "Any" in str(f.type)]


# ------------------------------------------------- a failure said once (failure_log)

def test_a_failure_goes_to_the_ranks_log_folder_only_where_the_launcher_sums_up(tmp_path):
    from train.core.run import failure_log
    logs = tmp_path / "attempt_0" / "1"
    logs.mkdir(parents=True)
    summed = WorkerIdentity(rank=1, status_dir=str(tmp_path), log_dir=str(logs))
    try:
        raise ValueError("no such table")
    except ValueError as exc:
        kept = failure_log.kept_off_console(summed, "error: x.yaml: data.factory: ...", exc)
        # one process, or plain torchrun: nobody else says it, the caller prints it
        alone = failure_log.kept_off_console(WorkerIdentity(rank=0), "error: ...", exc)
        bare = failure_log.kept_off_console(WorkerIdentity(rank=1, log_dir=str(logs)), "e")
    assert kept == logs / failure_log.TRACEBACK and alone is None and bare is None
    text = kept.read_text()
    assert "Traceback" in text and "ValueError: no such table" in text
    assert text.splitlines()[-1] == "error: x.yaml: data.factory: ..."
    # the report names the file, for the launcher's line
    mine = reporter(tmp_path, rank=1)
    mine.details = str(kept)
    assert mine.ended(2, "error: ...").details == str(kept)
    assert protocol.read_all(tmp_path)[0].details == str(kept)


def test_a_rank_knows_torchrun_stops_it_because_another_failed(tmp_path):
    from train.core.run import failure_log
    ident = WorkerIdentity(rank=0, status_dir=str(tmp_path), log_dir=str(tmp_path))
    assert not failure_log.stopped_for_another(ident)  # a stop of the whole job
    failure_log.stopping_after_failure(tmp_path, now=True)
    assert failure_log.stopped_for_another(ident)
    assert not failure_log.stopped_for_another(WorkerIdentity(rank=0, status_dir=str(tmp_path)))
    failure_log.stopping_after_failure(tmp_path, now=False)
    assert not failure_log.stopped_for_another(ident)
