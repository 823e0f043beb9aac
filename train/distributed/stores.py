"""The workers' store servers listen only where their clients connect.

A worker of rank 0 hosts the process group's store at ``MASTER_ADDR:MASTER_PORT``
(``init_process_group``'s ``env://``, whenever torchrun's agent does not share its own);
torch would listen on every interface. :func:`bind_store_servers` makes every
``TCPStore`` server this process starts bind the address ``MASTER_ADDR`` names
(:mod:`train.core.machine.binding` says where and why), and every client connect as soon as
its server listens, rather than after torch's backoff of about a second (the same
module says how). The trainer calls it before it joins the
process group, ``entrypoint.py launch`` before the user's script runs.
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from train.core.machine import binding


def _say(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr, flush=True)


def bind_store_servers() -> None:
    binding.install(dist, list(sys.modules.values()), _say, wait_for_server=True)
