"""One launch pipeline for every command: ``prepare`` (decide) then ``execute`` (run).

``train``, ``launch``, ``doctor`` and ``--dry-run`` all go through :func:`prepare`:
read the environment -> load and check the config -> detect GPUs -> the torch build
-> the launch plan -> torchft (``fault_tolerance: replicas``) -> the output folder -> the
object store (``checkpoint.remote``) -> /dev/shm. Each stage adds
:class:`~launcher.detection.hardware.Finding` records. ``doctor`` collects every finding and
reports them; the other commands stop at the first failure, raised as the one-line
error of its exit code (2 bad input, 3 cannot run here). So the commands cannot drift
apart: the same environment and config give the same findings and the same plan
whichever command asks (``tests/unit/test_runner.py``).

:mod:`launcher.running.execute` runs a prepared plan: the notes and warnings, the
run-directory lock (``train``), the wait for the rendezvous host, then
:mod:`launcher.running.supervise`.
A new launch convention touches :mod:`launcher.conventions` only; a new check is one
stage here, and every command gets it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from launcher.detection import system, torchft_tools
from launcher.detection.compat import check_build, install_fix
from launcher.detection.detect import detect, torch_build, torch_build_on_disk
from launcher.detection.hardware import Finding, Hardware, TorchBuild
from launcher.planning import environ as environ_mod
from launcher.planning.plan import plan as make_plan
from launcher.planning.variables import Environ
from launcher.running.prepared import Prepared, Request
from train.core.errors import CannotRunHere, ConfigError, UserError
from train.core.run import rundir

APP_ROOT = str(Path(__file__).resolve().parents[2])


def prepare(request: Request, env: Environ | None = None, *, hardware: Hardware | None = None,
            tb: TorchBuild | None = None, master_port: int | None = None) -> Prepared:
    """Run the stages in order. Raises the first failure's :class:`UserError` unless the
    request collects (doctor). hardware, tb: what was found, to plan for a made-up
    machine (tests); detected here when None."""
    p = Prepared(request, env if env is not None else environ_mod.read())
    _config(p)
    _hardware(p, hardware)
    _torch(p, tb)
    _plan(p, master_port)
    _fault_tolerance(p)
    _data(p)
    _output(p)
    _remote(p)
    _shm(p)
    _peers_reach_us(p)
    return p


def _fail(p: Prepared, error: UserError, topic: str) -> None:
    """Record a failure; in a command that stops at the first one, raise it as it is."""
    if not p.request.collects:
        raise error
    for each in getattr(error, "errors", [error]):  # every problem of a config
        p.findings.append(Finding("fail", "config" if each.exit_code == 2 else topic,
                                  each.one_line()[len("error: "):], None, each.exit_code))


def _add(p: Prepared, findings: list[Finding]) -> None:
    """Add findings; the first failure among them stops a non-collecting command. (A
    failing finding is always "cannot run here": bad input raises from the loaders.)"""
    for f in findings:
        p.findings.append(f)
        if f.level == "fail" and not p.request.collects:
            raise CannotRunHere(f"{f.message}; {f.fix}" if f.fix else f.message)


def _config(p: Prepared) -> None:
    from train.core.config import check_resume_compatible, load_config
    from train.core.config.origins import config_warnings
    from train.core.config.reading import load_overrides
    from train.core.user import usercode
    r = p.request
    try:
        if r.command == "launch":
            p.cfg = load_overrides(list(r.overrides), launch_defaults(r.script, r.overrides))
        elif r.config is None:
            p.cfg = default_config()
        else:
            p.cfg = load_config(r.config, list(r.overrides))
            # the user's own model, data and loss: read, not run (the workers run them)
            usercode.check_without_running(p.cfg, r.config)
            check_resume_compatible(p.cfg, r.config)
    except UserError as exc:
        p.cfg = None
        _fail(p, exc, "plan")
        return
    _add(p, [Finding("warn", "config", w) for w in config_warnings(p.cfg)])


# The keys a script's launch takes: where and how it runs, not what the trainer does.
LAUNCH_KEYS = ("distributed.", "device", "output.dir", "run.name")


def launch_defaults(script: tuple[str, ...], overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """``launch``'s config: the script's name as the run name, and no restarts (a script
    may not resume from where it stopped) unless asked for. The script must exist and the
    overrides be keys a launch uses (``optim.lr=1`` would be ignored: the trainer's)."""
    if not script:
        raise ConfigError("command line", "launch", "no script: launch [key=value ...] "
                                                    "SCRIPT.py [args] or launch -m MODULE [args]")
    for text in overrides:
        key = text.partition("=")[0].strip()
        if not key.startswith(LAUNCH_KEYS):
            raise ConfigError("command line", key, "not a key of launch: it takes "
                                                   "distributed.*, device, output.dir and "
                                                   "run.name (the rest is the trainer's; give "
                                                   "your script its own arguments)")
    if script[0] == "-m":
        import importlib.util
        sys.path.insert(0, os.getcwd())  # where `python -m` in the workers looks first
        try:
            found = importlib.util.find_spec(script[1])
        except (ImportError, ValueError):
            found = None
        finally:
            sys.path.remove(os.getcwd())
        if found is None:
            raise ConfigError("command line", f"-m {script[1]}", "no such module (from the "
                                                                  "working directory or the "
                                                                  "installed packages)")
    elif not Path(script[0]).is_file():
        raise ConfigError("command line", script[0], "no such script (a .py file, or -m "
                                                     "MODULE)")
    name = script[1] if script[0] == "-m" else Path(script[0]).stem
    return {"run.name": name, "distributed.max_restarts": 0}


def default_config():
    """doctor without a config: what ``train`` would plan for the defaults."""
    from train.core.config import Config
    cfg = Config()
    cfg.run.name = "doctor"
    return cfg


def _light_torch_build(p: Prepared) -> TorchBuild | None:
    """Without GPUs nothing needs the compiled-in architectures, and the workers import
    torch anyway: read the build from its files. doctor reports everything (imports it);
    mpi is built into few torches (import to ask)."""
    if p.hardware.gpus or p.request.command == "doctor" or \
            (p.cfg is not None and p.cfg.distributed.backend == "mpi"):
        return None
    return torch_build_on_disk()


def _hardware(p: Prepared, hardware: Hardware | None) -> None:
    p.hardware = hardware or detect(p.env)
    _add(p, [Finding("warn", "gpu", w) for w in p.hardware.warnings])


def _torch(p: Prepared, tb: TorchBuild | None) -> None:
    # This process's own torch use (a store client watching the rendezvous) must not
    # print C++ stack frames when the store goes away; read once, as torch loads. The
    # workers get the environment as it was (env.raw).
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    p.torch = tb or (_light_torch_build(p) or torch_build())
    if not p.torch.importable:
        _add(p, [Finding("fail", "torch", f"torch is not importable: {p.torch.error}",
                         install_fix(APP_ROOT), 3)])
    build = check_build(p.hardware, p.torch, p.env.visibility.hsa_override_gfx_version)
    if p.cfg is not None and p.cfg.device == "cpu":  # the GPUs are not needed: a warning
        build = [replace(f, level="warn", exit_code=0) if f.level == "fail" else f
                 for f in build]
    _add(p, build)


def _plan(p: Prepared, master_port: int | None) -> None:
    if p.cfg is None:
        return
    r = p.request
    source = r.config or ("command line" if r.command == "launch" else "<defaults>")
    try:
        p.plan = make_plan(p.cfg, p.hardware, p.torch, p.env, config_path=source,
                           overrides=list(r.overrides), python=sys.executable,
                           app_root=APP_ROOT,
                           master_port=system.free_port() if master_port is None
                           else master_port,
                           script=list(r.script) if r.command == "launch" else None,
                           lighthouse=torchft_tools.lighthouse_binary() if _replicas(p) else None)
    except UserError as exc:
        _fail(p, exc, "plan")
        return
    q = p.plan
    _add(p, [Finding("ok", "plan", f"{r.command if r.command != 'doctor' else 'train'} would "
                     f"run {q.nproc_per_node} process(es) per node on {q.device} with "
                     f"{q.backend}, nodes {q.nnodes[0]}:{q.nnodes[1]} ({q.convention})"
                     + (f", in each of {q.replica_groups.replicas} replica group(s) and "
                        f"{q.replica_groups.spares} spare(s)" if q.replica_groups else ""))])


def _replicas(p: Prepared) -> bool:
    return p.cfg is not None and p.cfg.distributed.fault_tolerance == "replicas"


def _fault_tolerance(p: Prepared) -> None:
    """Replica groups need torchft: its package for the workers, its Lighthouse binary
    for the launcher (exit 3 naming the install otherwise)."""
    if _replicas(p):
        _add(p, torchft_tools.check(torchft_tools.lighthouse_binary(),
                                    torchft_tools.torchft_found()))


def _data(p: Prepared) -> None:
    """data.kind tokens, for doctor and a dry run: the dataset's size, its order and what
    reading it fetches per epoch and node (a training launch skips it: one listing the
    less)."""
    if p.cfg is None or p.cfg.data.kind != "tokens" or not (p.request.collects or
                                                            p.request.dry_run):
        return
    from train.core.datasets import footprint, tokenfiles
    try:
        files = tokenfiles.resolve(p.cfg.data.path, p.request.config or "<defaults>")
    except UserError:
        return  # the config's own check said why
    p.data = footprint.describe(p.cfg, files, p.plan.nnodes[0] if p.plan else 1)
    p.data["lines"] = footprint.lines(p.data)


def _output(p: Prepared) -> None:
    if p.cfg is None:
        return
    # torchrun's logs go there for launch too
    _add(p, [system.check_output_dir(p.cfg.output.dir, create=p.request.writes)])
    try:
        rundir.check_no_links(p.cfg.run_dir)
    except UserError as exc:
        _fail(p, exc, "output")


def _remote(p: Prepared) -> None:
    """checkpoint.remote: boto3 installed and, unless nothing is to run (a dry run), the
    bucket writable under the run's prefix, before any worker starts."""
    if p.cfg is None or not p.cfg.checkpoint.remote:
        return
    from train.core.storage import s3 as remote_config
    try:
        remote_config.check(p.cfg.checkpoint.remote, p.cfg.run.name,
                            p.request.config or "<defaults>", p.env.raw,
                            probe=not p.request.dry_run)
    except UserError as exc:
        _fail(p, exc, "output")


def _peers_reach_us(p: Prepared) -> None:
    """Several nodes: gloo (and NCCL's bootstrap) give peers the address this host's name
    resolves to, unless an interface is named; a loopback address there means connection
    failures across hosts, long after the rendezvous."""
    if p.plan is None or p.plan.nnodes[1] < 2:
        return
    named = p.env.socket_ifname or p.cfg.distributed.socket_ifname or \
        p.env.get("GLOO_SOCKET_IFNAME") or p.env.get("NCCL_SOCKET_IFNAME")
    loopback = system.loopback_name()
    if loopback and not named:
        _add(p, [Finding("warn", "network",
                         f"this host's name {loopback[0]} resolves to {loopback[1]}, a "
                         "loopback address: the other nodes would be told to connect there",
                         "name the interface they reach (TRAIN_SOCKET_IFNAME=eth0 or "
                         "distributed.socket_ifname), or fix the name in /etc/hosts")])


def _shm(p: Prepared) -> None:
    _add(p, [system.check_shm()])


# ----------------------------------------------------------------------- running

def run(request: Request, log: Callable[[str], None], *, verbose: bool = False) -> int:
    """prepare, then print the plan (a dry run) or execute it."""
    prepared = prepare(request)
    if request.dry_run:
        print(prepared.plan.render((prepared.data or {}).get("lines", [])))
        return 0
    from launcher.running.execute import execute
    return execute(prepared, log, verbose=verbose)
