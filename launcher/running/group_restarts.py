"""How the torchrun of a replica group stops its workers for a restart: SIGTERM, then
SIGKILL after :data:`RESTART_STOP_S`, not torch's 30 s.

A restart of a group means the group failed: one of its workers died (torch stops the
others, then restarts them all), or, in a group of several nodes, another node's agent
started a new round. Its surviving workers can
neither finish the step nor write a checkpoint that matters (the live groups hold the
state the restarted workers heal from), and they are often blocked in a call that no
signal interrupts: torchft's quorum or commit vote, waiting for the dead rank. Meanwhile
the group's first rank keeps its Manager beating, so the Lighthouse keeps the group in
the quorum and the other groups wait: measured on a 4-node SLURM cluster (two groups of
two nodes), torch's 30 s stop held the other group for 33 s after a kill -9; stopped
this way it waits the Lighthouse's heartbeat timeout after the stop.

A stop of the whole job (a signal to torchrun) keeps the platform's grace
(``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``): the workers checkpoint then.
"""

from __future__ import annotations

RESTART_STOP_S = 2


def install() -> None:
    """Bound the stops of torch's local agent that are not a stop of the job: the
    workers stopped for a restart (a new round), and the others stopped because one of
    them failed."""
    from torch.distributed.elastic.agent.server import local_elastic_agent as agent
    from torch.distributed.elastic.multiprocessing import api
    cls, context = getattr(agent, "LocalElasticAgent", None), getattr(api, "PContext", None)
    if cls is None or context is None or not hasattr(cls, "_shutdown"):
        return  # another torch: its own stop

    def stop_workers_soon(self, worker_group) -> None:
        self._shutdown(timeout=RESTART_STOP_S)

    close = context.close

    def close_soon(self, death_sig=None, timeout: int = RESTART_STOP_S) -> None:
        close(self, death_sig, timeout)  # a stop of the job passes its grace

    cls._stop_workers = stop_workers_soon
    context.close = close_soon
