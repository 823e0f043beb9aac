"""``rendezvous [--port N]``: the standalone c10d store for multi-node elastic runs.

With the store in the agent of one worker node, losing that node loses the store
and every node restarts (kubeflow/trainer#1638). This process holds a
``torch.distributed.TCPStore`` server on its own (the Kubernetes rendezvous
Deployment + Service); worker nodes join it with ``is_host=false`` and a run id
unique to the job. It logs each run's rounds, members and waiting nodes as they
change (:mod:`launcher.liveness.rdzv_state` reads them safely), and stops cleanly on
SIGTERM/SIGINT.

:class:`~launcher.liveness.rounds.RoundWatcher` is the same view from a worker node.
"""

from __future__ import annotations

import datetime
import signal
import socket
import threading
from collections.abc import Callable

from launcher.liveness.rdzv_state import (
    PREFIX,
    STORE_ERRORS,
    describe,
    printable,
)


def _keys(store) -> list[str] | None:
    lister = getattr(store, "list_keys", None)  # newer torch; older: counts only
    if lister is None:
        return None
    try:
        return list(lister())
    except STORE_ERRORS:
        return None


def watch(store, seen: dict[str, str | None], log: Callable[[str], None]) -> None:
    """Log each rendezvous run's rounds, members and waiting nodes when they change."""
    keys = _keys(store)
    if keys is None:
        count = store.num_keys()
        if seen.get("#count") != str(count):
            seen["#count"] = str(count)
            log(f"store holds {count} key(s)")
        return
    for key in sorted(k for k in keys if k.startswith(PREFIX) and "." not in k[len(PREFIX):]):
        try:
            summary = describe(store.get(key))
        except STORE_ERRORS:
            continue
        if summary is not None and seen.get(key) != summary:
            log(f"run {printable(key[len(PREFIX):])!r}: {summary}")
        seen[key] = summary


def listen_problem(host: str) -> str | None:
    """Why this machine cannot listen on ``host``, or None (checked before torch's store,
    which would retry a bad address for a minute)."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return "not an address or a name that resolves; use an address of this machine " \
               "(the pod IP) or 0.0.0.0"
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.bind(address)
            return None
        except OSError:
            continue
    return "not an address of this machine; use one of its own (the pod IP) or 0.0.0.0"


def serve(port: int, log: Callable[[str], None], host: str = "0.0.0.0",
          poll_s: float = 2.0, stop: threading.Event | None = None,
          install_signals: bool = True) -> int:
    """Serve the store on ``host`` (its address: nothing else listens) until stopped."""
    import torch.distributed as dist

    from train.core.errors import CannotRunHere
    from train.core.machine.binding import listener
    stop = stop or threading.Event()
    if install_signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: stop.set())
    try:
        # torch's store would listen on every interface whatever host it is given: it
        # gets a socket bound here instead (train.core.machine.binding)
        sock, _ = listener(host, port, exact=True)
        bound = sock.getsockname()
        store = dist.TCPStore(host, bound[1], is_master=True, wait_for_workers=False,
                              master_listen_fd=sock.detach(),
                              timeout=datetime.timedelta(seconds=30))
    except Exception as exc:  # port in use, bad address
        raise CannotRunHere(f"cannot listen on {host}:{port}: {exc}; choose another --port") \
            from None
    where = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    log(f"rendezvous store listening on {where}:{store.port}; give worker nodes "
        f"--rdzv-backend c10d --rdzv-endpoint <this-service>:{store.port} "
        "--rdzv-conf is_host=false and a run id unique to the job")
    seen: dict[str, str | None] = {}
    while not stop.wait(poll_s):
        watch(store, seen, log)
    log("stopping: rendezvous store shut down")
    del store
    return 0
