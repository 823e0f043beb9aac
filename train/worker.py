"""One training worker: ``python -m train``'s main, plus a report of how it ended.

torchrun (or the launcher, for a single process) starts ``python -m train.worker
CONFIG [overrides]``. This runs the worker in-process and leaves a
:class:`~train.core.reports.Report` (exit code, error, log folder) in the launcher's
status folder, so the launcher can map torchrun's result to the user-facing exit
codes and name the failing rank in one line.
"""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

from train.core import reports, rundir
from train.core.errors import EXIT_TRAINING_FAILED, FINAL_EXIT_CODES
from train.core.host import die_with_parent
from train.core.identity import WorkerIdentity


def write_status(code: int, error: str | None, env: WorkerIdentity | None = None,
                 details: dict | None = None) -> None:
    """details: {"repeated": True, ...} when this attempt ended at once because the
    failure of the attempts before it repeated (see :func:`repeated_failure`)."""
    env = env or WorkerIdentity.from_environ()
    report = reports.Report(
        rank=env.rank, local_rank=env.local_rank, restart=env.restart_count, exit_code=code,
        error=error, log_dir=env.log_dir, checkpoint=newest_checkpoint(env),
        details=details or {})
    reports.write(env.status_dir, report)
    if code == EXIT_TRAINING_FAILED and not report.details.get("repeated"):
        reports.record_failure(env.status_dir, report)


def newest_checkpoint(env: WorkerIdentity) -> str | None:
    """The run's newest checkpoint, from the config the launch validated (supervised)."""
    if not env.config_snapshot:
        return None
    try:
        import yaml
        tree = yaml.safe_load(Path(env.config_snapshot).read_text(encoding="utf-8"))
        run_dir = Path(tree["output"]["dir"]) / tree["run"]["name"]
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
        return None
    return rundir.latest_name(run_dir / "checkpoints")


def repeated_failure(env: WorkerIdentity) -> dict | None:
    """The failure of the last attempt when the attempt before it failed the same way
    (the same error, from the same newest checkpoint): a restart cannot fix it. A rank
    that hung comes first: the others failed waiting for it."""
    if env.restart_count < 2 or not env.status_dir:
        return None
    seen = reports.failures(env.status_dir)
    last = [f for f in seen if f.get("restart") == env.restart_count - 1]
    before = [f for f in seen if f.get("restart") == env.restart_count - 2]
    again = [f for f in last if any(_same(f, g) for g in before)]
    again.sort(key=lambda f: f.get("hung") in (None, "ranks"))
    return again[0] if again else None


def _same(a: dict, b: dict) -> bool:
    """The same failure: the error alike but for numbers that change between attempts
    (ports, addresses, timings), from the same checkpoint."""
    def shape(error: object) -> str:
        return re.sub(r"0x[0-9a-fA-F]+|\d+", "N", str(error))
    return shape(a.get("error")) == shape(b.get("error")) and \
        a.get("checkpoint") == b.get("checkpoint")


def final_failure(env: WorkerIdentity) -> reports.Report | None:
    """An earlier round's report of a failure a restart cannot change (bad input, this
    machine cannot run it, divergence, a full disk, one that repeated), or None.
    torchrun restarts workers whatever their exit code; such a restart ends at once with
    the same answer."""
    if env.restart_count == 0 or not env.status_dir:
        return None
    return next((r for r in reports.read_all(env.status_dir)
                 if r.restart < env.restart_count and
                 (r.exit_code in FINAL_EXIT_CODES or r.details.get("repeated"))), None)


def main(argv: list[str]) -> int:
    # torchrun killed (or the launcher, in direct mode): stop like on SIGTERM, with a
    # checkpoint, instead of training on with no one to report to.
    die_with_parent(signal.SIGTERM)
    code, error = 1, None
    env = WorkerIdentity.from_environ()
    earlier = final_failure(env)
    if earlier is not None:
        print(f"rank {env.rank}: not restarting: rank {earlier.rank} ended with exit "
              f"{earlier.exit_code}, which a restart cannot change", file=sys.stderr)
        write_status(earlier.exit_code, earlier.error, env, earlier.details)
        return earlier.exit_code
    again = repeated_failure(env)
    if again is not None:
        where = again.get("checkpoint") or "the start (no checkpoint yet)"
        error = (f"{again.get('error')} (the same failure in two attempts in a row, from "
                 f"{where}: a restart cannot fix it, not restarted again)")
        print(f"rank {env.rank}: not restarting: {error}", file=sys.stderr)
        write_status(EXIT_TRAINING_FAILED, error, env, {
            "repeated": True, "rank": again.get("rank"), "hung": again.get("hung"),
            "log_dir": again.get("log_dir")})
        return EXIT_TRAINING_FAILED
    try:
        from train.__main__ import run
        code, error = run(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        raise
    except BaseException as exc:
        code, error = 1, f"{type(exc).__name__}: {exc}"
        raise
    finally:
        write_status(code, error)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
