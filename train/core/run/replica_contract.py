"""What the launcher and the workers of replica groups agree on
(``distributed.fault_tolerance: replicas``): the variables each group's workers get,
and the timeouts of torchft's Lighthouse and Manager, derived in one place so that they
keep their order.

The launcher starts one Lighthouse per job and one torchrun per group (its own
rendezvous and restarts); the workers of every group meet the other groups through
the Lighthouse. Torch-free: the launcher reads it.

The timeouts, from the shortest (each must be longer than the one before):

1. the Lighthouse's heartbeat timeout: a group whose Manager stops beating (killed,
   frozen, cut off) leaves the next quorum after this long;
2. the cross-group all-reduce (``distributed.replica_timeout_s``): how long a group
   waits in a step's all-reduce for the other groups. It must be longer than the
   difference between the groups' step times, or a slow step counts as a failure and is
   redone; a frozen group costs this much once;
3. the Manager's timeout (a heal, a commit vote): the all-reduce's plus a margin;
4. the quorum timeout: how long a group waits for a quorum (a new group's join, a
   heal from a live peer) before it fails.
"""

from __future__ import annotations

from dataclasses import dataclass

# Set by the launcher for every worker of a group. The first two are torchft's own names.
GROUP_VAR = "REPLICA_GROUP_ID"        # 0 .. groups-1: this worker's group
GROUPS_VAR = "NUM_REPLICA_GROUPS"     # the groups started: distributed.replicas + spares
LIGHTHOUSE_VAR = "TORCHFT_LIGHTHOUSE"  # http://HOST:PORT of the job's Lighthouse
ADDR_VAR = "TRAIN_REPLICA_ADDR"       # the address other groups reach this group's node at
# On GPUs the groups of one machine split its devices: group g's local rank r uses
# device offset + r (offset = g x nproc_per_node), never another group's.
DEVICE_OFFSET_VAR = "TRAIN_REPLICA_DEVICE_OFFSET"

# How often the Lighthouse checks for a quorum while it waits for stragglers.
QUORUM_TICK_MS = 100


@dataclass(frozen=True)
class Timeouts:
    """The ordered timeouts of one job, in the units each tool takes."""
    heartbeat_ms: int     # Lighthouse: a silent group is out of the next quorum
    join_ms: int          # Lighthouse: how long a quorum waits for groups still joining
    allreduce_s: float    # a step's cross-group all-reduce (gloo)
    manager_s: float      # a heal, a commit vote
    quorum_s: float       # waiting for a quorum

    @classmethod
    def of(cls, replica_timeout_s: float) -> Timeouts:
        allreduce = float(replica_timeout_s)
        return cls(heartbeat_ms=2000, join_ms=500, allreduce_s=allreduce,
                   manager_s=allreduce + 30.0, quorum_s=allreduce + 120.0)


def lighthouse_argv(binary: str, bind: str, timeouts: Timeouts) -> list[str]:
    """The Lighthouse's command line. One group is a quorum: the survivors of a loss
    train on alone; the groups still starting join the next step's quorum."""
    return [binary, "--bind", bind, "--min_replicas", "1",
            "--quorum_tick_ms", str(QUORUM_TICK_MS),
            "--heartbeat_timeout_ms", str(timeouts.heartbeat_ms),
            "--join_timeout_ms", str(timeouts.join_ms)]
