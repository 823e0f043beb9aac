"""torchrun, as the launcher runs it: ``python -m launcher.torchrun`` takes torchrun's
arguments and differs in what it says and in one identity detail.

- Stopped by a signal (SIGTERM from Kubernetes, systemd, ``timeout``, a forwarded
  Ctrl-C), torchrun forwards it to the workers, which checkpoint and exit, and then
  dies with a 25-line ``SignalException`` traceback. Here: ``128 + signal`` and one line.
- Losing the rendezvous store (its pod restarted, its node drained), torchrun stops the
  workers (they checkpoint) and dies with pages of C++ frames and Python tracebacks.
  Here: one line and exit :data:`~launcher.running.agent_contract.STORE_LOST`, which
  tells the launcher to wait for the store and start torchrun again (see
  :mod:`launcher.running.supervise`). The same when the store cannot be reached at start.
- A worker failing ends torchrun with a 20-line "Root Cause" table; here nothing: the
  launcher's last line names the rank that failed first, its error and its log.
- On a stop torchrun also logs "Received 15 death signal, shutting down workers" and a
  "Sending process N closing signal SIGTERM" per worker: the lines above say that once,
  so those two messages are dropped; so is "no error file defined for parent" after a
  worker failed (the launcher names the rank and its log). Every other torchrun message
  stays.
- A node leaving on purpose makes the others' workers stop with it (one checkpoint);
  their restart to go on without it costs no ``--max-restarts`` here. In a replica
  group a restart stops the workers within seconds, not torch's 30
  (:mod:`launcher.running.group_restarts`).
- Any other failed attempt is recorded for the launcher (how each local worker ended,
  and which ended before torchrun stopped the rest), and a restart is one line naming
  what failed (:mod:`launcher.endings.restarts`), in place of torch's "failed (exitcode: -9)"
  log line; an ending a restart cannot change is not restarted.
- An agent that ends with an error makes torch close the job's rendezvous for every
  node, for good; here only a finished job's agents close it (a node that gave up, or
  was cut off from the store, must not stop the others or its replacement).
- A node presents itself to the rendezvous as (address, pid, local id). Two pods with
  the same hostname and the same PID tree (a replacement pod, simulated nodes in PID
  namespaces) would be the same participant and hang. The local id is random here
  (the launcher picks it, so that it can tell its own node among a round's members),
  so every torchrun process is a participant of its own.

- A store this agent hosts (torchrun's rendezvous store on the node whose name is the
  endpoint, a static job's store on node 0) listens on the address its name resolves
  to here, not on every interface (:mod:`train.core.machine.binding`); and the rendezvous state
  the agent reads from the store is unpickled with an allow-list
  (:func:`launcher.liveness.rdzv_state.load_state`): a client of the store that writes another
  pickle there cannot run code in the agent.

C++ warnings of torch's store client (each with its stack frames) are silenced in
this process only; the workers keep the user's ``TORCH_CPP_LOG_LEVEL``.

Once torchrun has returned (its workers ended, their logs copied), the process ends
at once (:func:`train.core.machine.host.exit_now`): the interpreter's teardown of a process
that loaded torch is about 0.6 s of CPU, tens of seconds on a node that leaves it a few
percent of one, all of it after the stop checkpoint and inside the platform's grace
period (docs/slurm.md).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import secrets
import signal
import socket
import sys
from types import SimpleNamespace

from launcher.liveness.rdzv_state import load_state
from launcher.running import group_restarts
from launcher.running.agent_contract import LOCAL_ID_VAR, STORE_LOST
from train.core.errors import EXIT_PEER_STOPPED
from train.core.machine import binding
from train.core.machine.host import exit_now
from train.core.run import failure_log, protocol
from train.core.run.identity import STATUS_DIR_VAR
from train.core.run.replica_contract import GROUP_VAR


def _quiet_cpp_warnings():
    """Set TORCH_CPP_LOG_LEVEL=ERROR while torch loads (it is read then); return a
    function that restores the variable for the workers torchrun will start."""
    before = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"

    def restore() -> None:
        if before is None:
            os.environ.pop("TORCH_CPP_LOG_LEVEL", None)
        else:
            os.environ["TORCH_CPP_LOG_LEVEL"] = before
    return restore


def _unique_node_ids() -> None:
    """Start this process's rendezvous local ids at the launcher's number (LOCAL_ID_VAR,
    taken out of the workers' environment) or a random one (torch starts at 0).

    The generator is a class attribute of the handler, created when torch is imported;
    on a torch without it the identities stay torch's (addresses should then differ:
    set TRAIN_LOCAL_ADDR to the pod IP).
    """
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv
    handler = getattr(rdzv, "DynamicRendezvousHandler", None)
    generator = getattr(handler, "_node_desc_generator", None)
    if generator is None or not isinstance(getattr(generator, "_local_id", None), int):
        return
    chosen = os.environ.pop(LOCAL_ID_VAR, "")
    with generator._lock:
        generator._local_id = int(chosen) if chosen.isdigit() else secrets.randbits(31)


def _say(line: str) -> None:
    group = os.environ.get(GROUP_VAR)  # one torchrun of several (replica groups)
    who = f"torchrun (replica group {group})" if group else "torchrun"
    print(f"{who}: {line}", file=sys.stderr, flush=True)


def _bind_store_servers() -> None:
    """Every store server of this agent listens where its name says (the module
    docstring); the rendezvous backends import ``TCPStore`` by name, so load them first."""
    import torch.distributed as dist
    for backend in ("c10d_rendezvous_backend", "static_tcp_rendezvous"):
        try:
            __import__(f"torch.distributed.elastic.rendezvous.{backend}")
        except ImportError:
            pass
    binding.install(dist, list(sys.modules.values()), _say)


def _no_code_from_the_store() -> None:
    """The rendezvous state is read with the allow-list unpickler (the module docstring)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv
    classes = {name: getattr(rdzv, name, None) for name in ("_RendezvousState", "_NodeDesc")}
    if getattr(rdzv, "pickle", None) is not pickle or None in classes.values():
        return  # another torch: it does not read the state with pickle.loads here
    rdzv.pickle = SimpleNamespace(
        dumps=pickle.dumps, loads=lambda data: load_state(data, classes),
        PickleError=pickle.PickleError, UnpicklingError=pickle.UnpicklingError)


def _keep_the_rendezvous_open_on_failure() -> None:
    """torch closes the job's rendezvous (for every node, for good: RendezvousClosedError)
    whenever an agent ends with an error: a node cut off from the store for a minute, or
    one that used up its restarts, would then stop the whole job from ever meeting again,
    and its replacement pod (the same Job, the same run id) from joining. Here only the
    agent of a job that finished closes it; a failing one leaves it to the others."""
    from torch.distributed.elastic.agent.server import api as agent_api
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv
    agent, handler = agent_api.SimpleElasticAgent, rdzv.DynamicRendezvousHandler
    if not hasattr(agent, "run") or not hasattr(handler, "shutdown"):
        return  # another torch: its own behaviour
    failed = []
    run, shutdown = agent.run, handler.shutdown

    def run_noting_failure(self, *args, **kwargs):
        try:
            result = run(self, *args, **kwargs)
        except BaseException:
            failed.append(True)
            raise
        if result.is_failed():
            failed.append(True)
        return result

    def shutdown_unless_failed(self) -> bool:
        return True if failed else shutdown(self)

    agent.run = run_noting_failure
    handler.shutdown = shutdown_unless_failed


def _account_for_failed_attempts() -> None:
    """What torchrun decides after its workers failed, said and recorded here.

    - A node that leaves on purpose (scale-down, a one-node drain) makes every rank stop
      with a checkpoint; the ranks of the other nodes exit EXIT_PEER_STOPPED. torchrun
      counts any worker exit as a failure and spends one of ``--max-restarts`` on it;
      here such a restart is given back, so a planned departure costs no restart.
    - Any other failed attempt is recorded in the launcher's status folder
      (:data:`train.core.run.protocol.ATTEMPTS`: how each process ended, and which ended
      before torchrun stopped the others), so the launcher names a worker that died
      without a word (a signal leaves no report) rather than the ranks that lost their
      connection to it; a restart is said in one line; and an ending a restart cannot
      change (bad input, divergence, a failure that repeated) is not restarted.
    """
    from torch.distributed.elastic.agent.server import local_elastic_agent as local
    agent = local.LocalElasticAgent
    if not hasattr(agent, "_monitor_workers"):
        return
    monitor = agent._monitor_workers
    _note_the_first_to_end()

    def monitor_accounting(self, worker_group):
        # Read right before the agent decides to restart (and spends one restart on it)
        result = monitor(self, worker_group)
        failures = getattr(result, "failures", None) or {}
        if failures:  # torch has stopped the attempt's other processes
            failure_log.stopping_after_failure(os.environ.get(STATUS_DIR_VAR), now=False)
        if not failures or not hasattr(self, "_remaining_restarts"):
            return result
        if all(f.exitcode == EXIT_PEER_STOPPED for f in failures.values()):
            self._remaining_restarts += 1
            _say("another node left the job; meeting the others again (no restart counted)")
        else:
            try:
                _failed_attempt(self, worker_group, failures)
            except Exception as exc:
                # Saying it must never stop torchrun's own handling of the failure: this
                # runs inside torch's agent, reading the workers' reports and writing the
                # attempt's record, and any error of ours there would end the agent.
                _say(f"could not record the failed attempt ({_first_line(exc)})")
        return result

    agent._monitor_workers = monitor_accounting


# Set on torch's process context: the local ranks found ended before it stopped the rest.
_FIRST = "_train_first_to_end"


def _note_the_first_to_end() -> None:
    """torch finds a failed worker, then stops the others and reports them all alike:
    note which had ended when it first looked (the rest are its own stop)."""
    from torch.distributed.elastic.multiprocessing import api as mp
    context = getattr(mp, "SubprocessContext", None)
    capture = getattr(context, "_capture_process_failures", None)
    if capture is None:
        return  # another torch: the launcher takes torchrun's SIGTERM for its stop

    def capture_noting_first(self, done_local_ranks):
        capture(self, done_local_ranks)
        failed = getattr(self, "_failures", None)
        if failed and getattr(self, _FIRST, None) is None:
            setattr(self, _FIRST, frozenset(failed))
            # before torch stops the rest: their stop is not the job's (train.core.run.failure_log)
            failure_log.stopping_after_failure(os.environ.get(STATUS_DIR_VAR), now=True)

    context._capture_process_failures = capture_noting_first


def _failed_attempt(agent, group, failures: dict) -> None:
    """Record the attempt's exits; say the restart, or end the restarts a restart cannot
    help (the launcher's one line then names the rank and why)."""
    from launcher.endings import restarts
    spec, folder = group.spec, os.environ.get(STATUS_DIR_VAR)
    attempt = spec.max_restarts - agent._remaining_restarts
    pcontext = getattr(agent, "_pcontext", None)
    first = getattr(pcontext, _FIRST, None)
    logs = getattr(pcontext, "stderrs", None) or {}
    exits = [protocol.Exit(rank, f.local_rank, f.exitcode,
                           None if first is None else f.local_rank in first,
                           os.path.dirname(logs.get(f.local_rank) or "") or None)
             for rank, f in sorted(failures.items())]
    workers = list(group.workers)
    several_nodes = bool(workers) and workers[0].world_size > len(workers)
    host = socket.gethostname()
    reports = [r for r in protocol.read_all(folder) if r.restart == attempt] if folder else []
    what, final, stopped = restarts.attempt_verdict(reports, exits, len(workers),
                                                    host if several_nodes else None,
                                                    restarts.take_stop_note(folder))
    if stopped:  # the launcher killed them on purpose: no death
        exits = [dataclasses.replace(x, first=False) for x in exits]
    if final:
        agent._remaining_restarts = 0
    restarting = agent._remaining_restarts > 0
    protocol.record_attempt(folder, protocol.Attempt(attempt, exits, host, spec.max_restarts,
                                                     restarting))
    if restarting:
        _say(restarts.restarting(what, attempt + 1, spec.max_restarts))


# torch's elastic loggers and the messages of theirs this module (or the launcher's one
# line naming the failing rank and its log) says in its own words.
_SAID_HERE = {
    "torch.distributed.elastic.agent.server.api": ("Received %s death signal",),
    "torch.distributed.elastic.multiprocessing.api": ("Sending process %s closing signal",
                                                      "failed (exitcode: %s)"),
    "torch.distributed.elastic.multiprocessing.errors.error_handler":
        ("no error file defined for parent",),
}


def _drop_repeated_stop_messages() -> None:
    for name, prefixes in _SAID_HERE.items():
        logging.getLogger(name).addFilter(
            lambda record, prefixes=prefixes: not str(record.msg).startswith(prefixes))


def _first_line(exc: BaseException) -> str:
    cause = exc.__cause__ or exc
    text = " ".join(str(cause).split()) or type(cause).__name__
    return f"{type(cause).__name__}: {text[:200]}"


def main() -> int:
    restore = _quiet_cpp_warnings()
    import torch.distributed  # noqa: F401 - loads libtorch with the quiet log level
    restore()
    from torch.distributed import DistNetworkError, DistStoreError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousConnectionError,
        RendezvousStateError,
        RendezvousTimeoutError,
    )
    from torch.distributed.run import main as torchrun_main
    _unique_node_ids()
    _bind_store_servers()
    _no_code_from_the_store()
    _keep_the_rendezvous_open_on_failure()
    _account_for_failed_attempts()
    _drop_repeated_stop_messages()
    if os.environ.get(GROUP_VAR):  # a replica group: a restart stops its workers at once
        group_restarts.install()
    try:
        torchrun_main()
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        _say(f"stopped by {name}; workers were told to checkpoint and exit")
        return 128 + int(exc.sigval)
    except (RendezvousConnectionError, DistNetworkError, DistStoreError) as exc:
        print(f"torchrun: lost the rendezvous store ({_first_line(exc)}); workers were told "
              "to checkpoint and exit", file=sys.stderr, flush=True)
        return STORE_LOST
    except ChildFailedError:  # the launcher's last line names the rank, from the reports
        return 1
    except RendezvousStateError as exc:  # refused by the allow-list: someone wrote it
        print(f"torchrun: the rendezvous state in the store is not torch's, not loaded "
              f"({_first_line(exc)}): something other than the job's nodes writes to the "
              "store; keep its port reachable by the job's nodes only (docs/security.md)",
              file=sys.stderr, flush=True)
        return 1
    except RendezvousTimeoutError as exc:
        print(f"torchrun: the rendezvous did not complete in time ({_first_line(exc)}): "
              "fewer nodes than the minimum joined within distributed.rdzv_join_timeout_s",
              file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    exit_now(main())
