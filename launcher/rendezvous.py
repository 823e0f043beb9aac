"""``rendezvous [--port N]``: the standalone c10d store for multi-node elastic runs.

With the store in the agent of one worker node, losing that node loses the store
and every node restarts (kubeflow/trainer#1638). This process holds a
``torch.distributed.TCPStore`` server on its own (the Kubernetes rendezvous
Deployment + Service); worker nodes join it with ``is_host=false`` and a run id
unique to the job. It logs rendezvous runs appearing and their state changing
(never unpickling what clients wrote), and stops cleanly on SIGTERM/SIGINT.
"""

from __future__ import annotations

import datetime
import hashlib
import signal
import threading
from collections.abc import Callable

PREFIX = "torch.rendezvous."


def _keys(store) -> list[str] | None:
    lister = getattr(store, "list_keys", None)  # newer torch; older: counts only
    if lister is None:
        return None
    try:
        return list(lister())
    except Exception:
        return None


def _digest(store, key: str) -> str | None:
    try:
        return hashlib.sha1(store.get(key)).hexdigest()[:8]
    except Exception:
        return None


def watch(store, seen: dict[str, str | None], log: Callable[[str], None]) -> None:
    """Log new rendezvous runs and changes of their state (joins, rounds, leaves)."""
    keys = _keys(store)
    if keys is None:
        count = store.num_keys()
        if seen.get("#count") != str(count):
            seen["#count"] = str(count)
            log(f"store holds {count} key(s)")
        return
    for key in sorted(k for k in keys if k.startswith(PREFIX) and "." not in k[len(PREFIX):]):
        digest = _digest(store, key)
        run_id = key[len(PREFIX):]
        if key not in seen:
            log(f"run {run_id!r}: first node joined")
        elif seen[key] != digest:
            log(f"run {run_id!r}: membership/round changed (a node joined, left or restarted)")
        seen[key] = digest


def serve(port: int, log: Callable[[str], None], host: str = "0.0.0.0",
          poll_s: float = 2.0, stop: threading.Event | None = None,
          install_signals: bool = True) -> int:
    import torch.distributed as dist
    stop = stop or threading.Event()
    if install_signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: stop.set())
    try:
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=30))
    except Exception as exc:  # port in use, bad address
        from train.errors import CannotRunHere
        raise CannotRunHere(f"cannot listen on {host}:{port}: {exc}; choose another --port") \
            from None
    log(f"rendezvous store listening on {host}:{store.port}; give worker nodes "
        f"--rdzv-backend c10d --rdzv-endpoint <this-service>:{store.port} "
        "--rdzv-conf is_host=false and a run id unique to the job")
    seen: dict[str, str | None] = {}
    while not stop.wait(poll_s):
        watch(store, seen, log)
    log("stopping: rendezvous store shut down")
    del store
    return 0
