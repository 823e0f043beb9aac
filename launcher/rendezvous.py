"""``rendezvous [--port N]``: the standalone c10d store for multi-node elastic runs.

With the store in the agent of one worker node, losing that node loses the store
and every node restarts (kubeflow/trainer#1638). This process holds a
``torch.distributed.TCPStore`` server on its own (the Kubernetes rendezvous
Deployment + Service); worker nodes join it with ``is_host=false`` and a run id
unique to the job. It logs each run's rounds, members and waiting nodes as they
change, reading the state torchrun's agents write with an allow-list unpickler (no
class outside the rendezvous state is ever built), and stops cleanly on SIGTERM/SIGINT.
"""

from __future__ import annotations

import base64
import copyreg
import datetime
import io
import pickle
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


class _Stub:
    """Stands in for torchrun's rendezvous classes: holds their fields, runs no code."""

    def __setstate__(self, state: object) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)


_RDZV = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
_STUBS = {name: type(name, (_Stub,), {}) for name in ("_RendezvousState", "_NodeDesc")}
_SAFE = {("datetime", "datetime"): datetime.datetime, ("datetime", "timezone"): datetime.timezone,
         ("datetime", "timedelta"): datetime.timedelta, ("copyreg", "_reconstructor"):
         copyreg._reconstructor, ("builtins", "object"): object, ("builtins", "set"): set,
         ("builtins", "frozenset"): frozenset}


class _AllowList(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == _RDZV and name in _STUBS:
            return _STUBS[name]
        if (module, name) in _SAFE:
            return _SAFE[(module, name)]
        raise pickle.UnpicklingError(f"refusing {module}.{name}")


def printable(text: str, limit: int = 80) -> str:
    """Text from the network as one log-safe line: control characters (newlines, ANSI
    escapes) shown as escapes, so a node's name cannot forge or garble log lines."""
    out = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                  for c in str(text))
    return out if len(out) <= limit else out[: limit - 3] + "..."


def _node(desc: object) -> str:
    return printable(f"{getattr(desc, 'addr', '?')}:{getattr(desc, 'pid', '?')}")


def describe(raw: bytes) -> str | None:
    """A one-line summary of a c10d rendezvous state value; None when unreadable."""
    try:
        state = _AllowList(io.BytesIO(base64.b64decode(raw))).load()
    except Exception:
        return None
    members = sorted(getattr(state, "participants", {}).items(), key=lambda kv: kv[1])
    waiting = sorted(_node(n) for n in getattr(state, "wait_list", ()))
    text = (f"round {getattr(state, 'round', '?')} "
            f"{'complete' if getattr(state, 'complete', False) else 'forming'}: "
            f"{len(members)} node(s) [" + ", ".join(f"{_node(n)} rank {r}" for n, r in members)
            + "]")
    if waiting:
        text += f"; waiting to join: {', '.join(waiting)}"
    if getattr(state, "closed", False):
        text += "; closed (a new job needs a new run id)"
    return text


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
        except Exception:
            continue
        if summary is not None and seen.get(key) != summary:
            log(f"run {printable(key[len(PREFIX):])!r}: {summary}")
        seen[key] = summary


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
