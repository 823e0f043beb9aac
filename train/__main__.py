"""``python -m train CONFIG [dotted.key=value ...] [--print-config]``: one worker.
``python -m train --help-config`` lists every config key.

Runs standalone (one process) or as a torchrun worker. The launcher
(``entrypoint.py train``) validates everything before starting workers; this entry
validates again, so it is safe to call directly.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from train.core.config import check_resume_compatible, load_config, to_yaml
from train.core.config.origins import config_warnings
from train.core.config.reading import dashed_override
from train.core.datasets import tokenscan
from train.core.errors import EXIT_TRAINING_FAILED, UnfitNodes, UserError, printable
from train.core.files import write_atomic
from train.core.machine import threads
from train.core.machine.host import exit_now
from train.core.run import failure_log, peers, rundir
from train.core.run.identity import WorkerIdentity, check_environ
from train.core.run.protocol import Reporter
from train.core.storage.credentials import redacted
from train.core.user import usercode


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m train", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="YAML config file")
    parser.add_argument("overrides", nargs="*", metavar="dotted.key=value",
                        help="override config keys, e.g. optim.lr=3e-4 train.max_steps=100")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (defaults filled in) and exit")
    parser.add_argument("--help-config", nargs=0, action=_HelpConfig,
                        help="list every config key with its type, default and meaning")
    return parser.parse_intermixed_args(argv)


class _HelpConfig(argparse.Action):
    """--help-config: like --help, answers at once (no config needed, no torch)."""

    def __call__(self, parser, namespace, values, option_string=None):
        from train.core.config.reference import text
        sys.stdout.write(text())
        parser.exit(0)


def run(argv: list[str], reporter: Reporter | None = None) -> tuple[int, str | None]:
    """(exit code, the one-line error printed, if any). train.worker reports both, with
    ``reporter``, which learns the run's checkpoint folder here, from the config
    as loaded once."""
    try:
        for arg in argv:  # --optim.lr=1e-3: an override with dashes, one line, exit 2
            dashed = dashed_override(arg)
            if dashed is not None:
                raise dashed
        args = parse_args(argv)
        check_environ()
        threads.apply_before_torch()  # a bare worker: the launcher's wait policy, if unset
        env = WorkerIdentity.from_environ()
        # Under the launcher: the config it validated, however often torchrun restarts us
        cfg = load_config(env.config_snapshot or args.config, args.overrides,
                          source=args.config)
        if reporter is not None:
            reporter.checkpoints = cfg.run_dir / rundir.CHECKPOINTS
        if env.status_dir is None and env.rank == 0:  # else the launcher printed them
            for warning in config_warnings(cfg):
                print(f"warning: {printable(warning)}", file=sys.stderr, flush=True)
        if args.print_config:
            sys.stdout.write(to_yaml(cfg))
            return 0, None
        # the user's code imported (the launcher only read it); a bare worker's model
        # factory is asked here, before the run directory is written; the data, model and
        # loss run on one sample in the build, before step 1: a mistake is exit 2
        usercode.check(cfg, args.config, module=not env.supervised)
        check_resume_compatible(cfg, args.config)
        tokenscan.record(cfg.run_dir)  # a bare worker's scan of the token files, if any
        from train.loop.trainer import train  # torch is imported only when training
        return train(cfg, args.config, reporter=reporter), None
    except UserError as exc:
        # with the traceback of what your own code raised, when that is the cause
        cause = exc.__cause__ or exc.__context__
        if not _kept(reporter, failure_log.kept_off_console(_ident(reporter), exc.one_line(),
                                                            cause)):
            print(exc.one_line(), file=sys.stderr)
        if isinstance(exc, UnfitNodes) and reporter is not None:
            reporter.unfit_hosts = list(exc.hosts)
        return exc.exit_code, exc.one_line()
    except Exception as exc:  # one line here; the traceback goes to this rank's log
        record_for_torchrun(exc)
        message = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line, always
        ident = _ident(reporter)
        line = f"error: rank {ident.rank}: {printable(message)}"
        kept = peers.survived(ident.rank, message, ident.log_dir,
                              quiet=failure_log.summed_up(ident)) or \
            failure_log.kept_off_console(ident, line, exc)
        if not _kept(reporter, kept):
            import logging
            logging.getLogger("train").exception("training failed")
            print(line, file=sys.stderr)
        return EXIT_TRAINING_FAILED, f"{type(exc).__name__}: {exc}"


def _ident(reporter: Reporter | None) -> WorkerIdentity:
    return reporter.ident if reporter is not None else WorkerIdentity.from_environ()


def _kept(reporter: Reporter | None, kept: Path | None) -> bool:
    """The failure went to this rank's log folder (:mod:`train.core.run.failure_log`): the
    report names the file, for the launcher's line."""
    if kept is not None and reporter is not None:
        reporter.details = str(kept)
    return kept is not None


def main(argv: list[str] | None = None) -> int:
    return run(sys.argv[1:] if argv is None else argv)[0]


def record_for_torchrun(exc: BaseException) -> None:
    """Under torchrun, write the error file its failure summary reads (root cause, rank);
    it lies in RUN_DIR/logs/, so with any credential of the message hidden."""
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
        ErrorHandler().record_exception(exc)
        path = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if path and os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                text = f.read()
            if redacted(text) != text:
                write_atomic(Path(path), redacted(text))
    except Exception:  # on the way out with an error, nothing here may hide it (no
        pass           # torchrun, an older torch): the stderr line is enough


if __name__ == "__main__":
    exit_now(main())
