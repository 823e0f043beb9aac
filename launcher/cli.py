"""Command dispatch for ``entrypoint.py`` (the image's ENTRYPOINT, behind tini) and the
``trainpod`` command a pip install of the project gives (the same code path).

Only dispatch lives here; each command's work is in its own module. Nothing heavy
is imported before a command needs it, so ``--help`` answers at once, and nothing is
torn down after it ended (:func:`entry`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn

APP_ROOT = str(Path(__file__).resolve().parent.parent)  # the checkout, or /app in the image

HELP = """\
usage: entrypoint.py COMMAND [ARGS ...]

commands:
  train CONFIG [dotted.key=value ...] [--dry-run] [--verbose]
                      validate, detect GPUs, plan and run training (torchrun when
                      more than one process); --dry-run prints the plan and exits;
                      --verbose lists every variable set for the workers
  train --help-config every config key with its type, default and meaning
  doctor [--json] [--comm] [CONFIG [dotted.key=value ...]]
                      what was detected and whether training can run here;
                      --comm also runs the preflight check across local processes
                      (a timed matmul on each, a timed all-reduce among them)
  launch [--dry-run] [dotted.key=value ...] SCRIPT.py [args ...]
  launch [--dry-run] [dotted.key=value ...] -m MODULE [args ...]
                      your own torchrun-compatible script under the same plan as
                      train (GPU detection, backend, one process per GPU, cluster
                      conventions, restarts, signals, exit codes); the keys are
                      distributed.*, device, output.dir, run.name
  rendezvous [--port N]
                      the standalone rendezvous store for multi-node elastic runs
                      (default port 29400)
  lighthouse [--port N] [CONFIG [dotted.key=value ...]]
                      torchft's Lighthouse for replica groups run as a service of
                      the job (Kubernetes: k8s/kustomize/replicas; default port 29510)
  export RUN_DIR      consolidated weights + model config from the newest checkpoint
  generate RUN_DIR [--prompt TEXT] [--tokens N] [--temperature T] [--top-k K] [--seed S]
                      text from an exported byte-level GPT (the quick start's model)
  tokenize CORPUS_DIR --tokenizer DIR --out FILE [--glob GLOB] [--eos TOKEN] [--force]
                      a text corpus as the token file data.kind: tokens reads, with a
                      Hugging Face tokenizer from a local folder (make hf installs it)
  anything else       executed as a command: bash, python, tensorboard --logdir runs

"""


def _help_text() -> str:
    """HELP, then every exit code with its meaning (from the one table of them)."""
    import textwrap

    from train.core.errors import EXIT_MEANINGS
    codes = "; ".join(f"{code} {meaning}" for code, meaning in EXIT_MEANINGS.items())
    return HELP + textwrap.fill("exit codes: " + codes + ".", width=80) + "\n"


# Third-party packages the commands import; missing ones mean the wrong Python (exit 3).
DEPENDENCIES = {"yaml", "torch", "numpy", "pynvml", "tensorboard"}


def log(message: str) -> None:
    from train.core.errors import printable  # what users set is echoed escaped
    print(f"entrypoint: {printable(message)}", file=sys.stderr, flush=True)


class _Parser(argparse.ArgumentParser):
    """argparse that raises a one-line ConfigError (exit 2) instead of printing usage."""

    def error(self, message: str):
        from train.core.errors import ConfigError
        raise ConfigError("command line", self.prog.split()[-1], message)

    def parse_args(self, args=None, namespace=None):
        _reject_dashed_overrides(args or [])
        return super().parse_args(args, namespace)


def _reject_dashed_overrides(args: list[str]) -> None:
    """``--optim.lr=1e-3``: one line (exit 2) saying overrides have no dashes."""
    if any(a.startswith("--") for a in args):
        from train.core.config.reading import dashed_override
        for arg in args:
            problem = dashed_override(arg) if arg.startswith("--") else None
            if problem is not None:
                raise problem


def _split_flags(args: list[str], flags: set[str]) -> tuple[set[str], list[str]]:
    """Pull known --flags out of the argument list so overrides can sit around them."""
    found = {a for a in args if a in flags}
    return found, [a for a in args if a not in flags]


def cmd_train(args: list[str]) -> int:
    from launcher.running import runner
    parser = _Parser(prog="entrypoint.py train", add_help=True)
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--verbose", "-v", action="store_true")
    ns = parser.parse_args(args)
    return runner.run(runner.Request("train", ns.config, tuple(ns.overrides),
                                     dry_run=ns.dry_run), log, verbose=ns.verbose)


def split_launch_args(args: list[str]) -> tuple[bool, list[str], list[str]]:
    """(dry run, config overrides, the script and its arguments): options and overrides
    come before the script; everything after it is the script's."""
    from train.core.errors import ConfigError
    dry, overrides = False, []
    for i, arg in enumerate(args):
        if arg == "--dry-run":
            dry = True
        elif arg == "-m" or not ("=" in arg and not arg.startswith("-")):
            script = args[i:]
            if script[0] == "-m" and len(script) < 2:
                break
            if script[0].startswith("-") and script[0] != "-m":
                _reject_dashed_overrides(script[:1])  # --distributed.nproc_per_node=2
                raise ConfigError("command line", script[0], "unknown option of launch; see "
                                                             "--help")
            return dry, overrides, script
        else:
            overrides.append(arg)
    raise ConfigError("command line", "launch", "no script: launch [key=value ...] SCRIPT.py "
                                                "[args] or launch -m MODULE [args]")


def cmd_launch(args: list[str]) -> int:
    from launcher.running import runner
    dry, overrides, script = split_launch_args(args)
    return runner.run(runner.Request("launch", overrides=tuple(overrides), script=tuple(script),
                                     dry_run=dry), log)


def cmd_doctor(args: list[str]) -> int:
    from launcher.commands import doctor
    from launcher.planning import environ
    flags, rest = _split_flags(args, {"--json", "--comm"})
    parser = _Parser(prog="entrypoint.py doctor")
    parser.add_argument("config", nargs="?")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--comm-timeout", type=float, default=60.0)
    ns = parser.parse_args(rest)
    if not 0 < ns.comm_timeout <= 3600:  # also refuses nan
        parser.error(f"--comm-timeout {ns.comm_timeout}: expected seconds in (0, 3600]")
    return doctor.main(environ.read(), ns.config, ns.overrides, as_json="--json" in flags,
                       comm="--comm" in flags, comm_timeout_s=ns.comm_timeout)


def cmd_rendezvous(args: list[str]) -> int:
    from launcher.commands import rendezvous
    from launcher.conventions import DEFAULT_RDZV_PORT
    parser = _Parser(prog="entrypoint.py rendezvous")
    parser.add_argument("--port", type=int, default=DEFAULT_RDZV_PORT)
    parser.add_argument("--host", default="0.0.0.0")
    ns = parser.parse_args(args)
    if not 0 <= ns.port < 65536:
        parser.error(f"--port {ns.port}: expected 0..65535")
    problem = rendezvous.listen_problem(ns.host)
    if problem:
        parser.error(f"--host {ns.host}: {problem}")
    return rendezvous.serve(ns.port, log, host=ns.host)


def cmd_lighthouse(args: list[str]) -> int:
    from launcher.commands import lighthouse
    parser = _Parser(prog="entrypoint.py lighthouse")
    parser.add_argument("--port", type=int, default=lighthouse.DEFAULT_PORT)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("config", nargs="?")
    parser.add_argument("overrides", nargs="*")
    ns = parser.parse_args(args)
    if not 0 < ns.port < 65536:
        parser.error(f"--port {ns.port}: expected 1..65535")
    return lighthouse.serve(ns.config, ns.overrides, ns.host, ns.port, log)


def in_training_package(module: str, args: list[str], *, torch: bool = True) -> int:
    """Commands that load checkpoints or exports with torch (or, torch=False, that only
    write data files) run inside the training package: this process becomes ``python -m
    MODULE``, from any directory."""
    import importlib.util
    # without torch: the one-line answer of main(), not a traceback
    if torch and importlib.util.find_spec("torch") is None:
        raise ModuleNotFoundError("No module named 'torch'", name="torch")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [APP_ROOT, env.get("PYTHONPATH")]))
    os.execve(sys.executable, [sys.executable, "-m", module, *args], env)


def cmd_export(args: list[str]) -> int:
    return in_training_package("train.export", args)


def cmd_generate(args: list[str]) -> int:
    return in_training_package("train.generate", args)


def cmd_tokenize(args: list[str]) -> int:
    return in_training_package("train.tokenize_corpus", args, torch=False)


def cmd_exec(args: list[str]) -> int:
    from train.core.errors import ConfigError
    try:
        os.execvp(args[0], args)
    except FileNotFoundError:
        raise ConfigError("command line", args[0], "unknown command: not train, launch, "
                          "doctor, rendezvous, lighthouse, export, generate or tokenize, "
                          "and no such executable on PATH; see --help") from None
    except PermissionError:
        raise ConfigError("command line", args[0], "not executable") from None
    return 0  # not reached


COMMANDS = {"train": cmd_train, "launch": cmd_launch, "doctor": cmd_doctor,
            "rendezvous": cmd_rendezvous, "lighthouse": cmd_lighthouse, "export": cmd_export,
            "generate": cmd_generate, "tokenize": cmd_tokenize}


def _command_name() -> str:
    """How the user runs this: the installed command, or the checkout's/image's script."""
    return "trainpod" if Path(sys.argv[0]).name == "trainpod" else "entrypoint.py"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if _command_name() == "trainpod":  # what the run's closing lines tell the user to type
        from train.core.run.identity import COMMAND_VAR
        os.environ[COMMAND_VAR] = "trainpod"
    if not argv or argv[0] in ("-h", "--help", "help") or \
            (argv[0] in COMMANDS and argv[0] != "launch" and
             ("-h" in argv[1:] or "--help" in argv[1:])) or \
            (argv[0] == "launch" and argv[1:2] in (["-h"], ["--help"])):
        print(_help_text().replace("entrypoint.py", _command_name()), end="")
        return 0
    if argv[0] == "train" and "--help-config" in argv[1:]:
        from train.core.config.reference import text  # torch-free
        print(text(), end="")
        return 0
    from train.core.errors import UserError
    try:
        if argv[0] in COMMANDS:
            return COMMANDS[argv[0]](argv[1:])
        if argv[0].startswith("-"):
            from train.core.errors import ConfigError
            raise ConfigError("command line", argv[0], "unknown option; see --help")
        return cmd_exec(argv)
    except UserError as exc:
        print(exc.one_line(), file=sys.stderr, flush=True)
        return exc.exit_code
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in DEPENDENCIES:
            raise  # one of ours: a bug, keep the traceback
        from launcher.detection.compat import install_fix
        print(f"error: {exc.name} is not installed for {sys.executable}; "
              f"{install_fix(APP_ROOT)}", file=sys.stderr, flush=True)
        return 3
    except KeyboardInterrupt:
        return 143  # before any worker started: nothing to checkpoint


def entry() -> NoReturn:
    """The command's process (entrypoint.py, ``trainpod``): main's exit code, without the
    interpreter's teardown (:func:`train.core.machine.host.exit_now`), which after a stop would
    spend the platform's grace period (SLURM's KillWait) on a node starved of CPU."""
    from train.core.machine.host import exit_now
    exit_now(main())
