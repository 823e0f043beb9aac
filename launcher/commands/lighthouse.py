"""``lighthouse [--port N] [--host H] [CONFIG [dotted.key=value ...]]``: torchft's
Lighthouse (the replica groups' quorum service) on its own, for a platform that runs it
as a service of the job: on Kubernetes, the Deployment + Service of k8s/kustomize/replicas,
which outlives any worker pod and is replaced when lost.

On one machine and on SLURM the launcher starts the Lighthouse itself
(:mod:`launcher.running.lighthouse`); here the same command line
(:func:`train.core.run.replica_contract.lighthouse_argv`, timeouts from the config's
``distributed.replica_timeout_s``) replaces this process, so the container's init
(tini) signals the Lighthouse directly. Missing torchft is exit 3 naming how to install
it; a bad config, exit 2.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from launcher.detection.torchft_tools import INSTALL, LIGHTHOUSE, lighthouse_binary
from launcher.planning.replica_plan import shell
from train.core.errors import CannotRunHere
from train.core.run.replica_contract import Timeouts, lighthouse_argv

DEFAULT_PORT = 29510


def argv(config: str | None, overrides: list[str], host: str, port: int) -> list[str]:
    """The Lighthouse's command line for this config (its defaults without one)."""
    from train.core.config import Config, load_config
    # the job's config, read as its groups read it (distributed.* of replica groups)
    cfg = load_config(config, ["distributed.fault_tolerance=replicas", *overrides]) \
        if config else Config()
    binary = lighthouse_binary()
    if binary is None:
        raise CannotRunHere(f"no {LIGHTHOUSE} binary here (the replica groups' Lighthouse "
                            f"comes with torchft): {INSTALL}, in the image this runs")
    bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return lighthouse_argv(binary, bind, Timeouts.of(cfg.distributed.replica_timeout_s))


def serve(config: str | None, overrides: list[str], host: str, port: int,
          log: Callable[[str], None]) -> int:
    """Become the Lighthouse (exec): its quorums' lines at RUST_LOG=info, warnings only
    by default."""
    command = argv(config, overrides, host, port)
    log(f"run {shell(command)} (the replica groups' Lighthouse)")
    env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
    os.execve(command[0], command, env)
    return 0  # not reached
