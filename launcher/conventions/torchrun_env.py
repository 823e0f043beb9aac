"""torchrun's own variables: every torchrun flag may come as ``PET_<FLAG>``.

Kubeflow's elastic PyTorchJob sets them (``PET_NNODES=1:4``, ``PET_RDZV_ENDPOINT``,
``PET_RDZV_ID``, ``PET_NPROC_PER_NODE``, ...), and so can a user who wants a plain
multi-node torchrun. Detected by ``PET_NNODES`` or ``PET_RDZV_ENDPOINT``. Without an
endpoint the rendezvous is static (``PET_MASTER_ADDR``/``PORT``, ``PET_NODE_RANK``);
with one, dynamic (c10d unless ``PET_RDZV_BACKEND`` says otherwise).
"""

from __future__ import annotations

from launcher.conventions.common import (
    Nodes,
    Timings,
    dynamic_rendezvous,
    env_error,
    heartbeat_of,
    parse_endpoint,
    parse_nnodes,
    parse_port,
    parse_rdzv_conf,
    static_rendezvous,
)
from launcher.planning.variables import Environ

NAME = "torchrun-env"
# torchrun's --nproc-per-node also takes these words; the plan decides them itself.
NPROC_WORDS = ("auto", "gpu", "cpu")


def detect(env: Environ) -> bool:
    return bool(env.get("PET_NNODES") or env.get("PET_RDZV_ENDPOINT"))


def _int(env: Environ, flag: str) -> int | None:
    value = env.get(f"PET_{flag}")
    if value is None:
        return None
    if not value.isdigit():
        raise env_error(f"PET_{flag}", f"got {value!r}; expected an integer")
    return int(value)


def _nproc(env: Environ) -> int | None:
    value = env.get("PET_NPROC_PER_NODE")
    if value in NPROC_WORDS:
        return None  # the plan chooses: one per usable GPU, or 1 on CPU
    n = _int(env, "NPROC_PER_NODE")
    if n == 0:
        raise env_error("PET_NPROC_PER_NODE", "got '0'; expected at least 1 process, or auto")
    return n


def nodes(env: Environ, timings: Timings) -> Nodes:
    nnodes = env.get("PET_NNODES") or "1"
    lo, hi = parse_nnodes(nnodes, "PET_NNODES")
    endpoint = env.get("PET_RDZV_ENDPOINT")
    backend = env.get("PET_RDZV_BACKEND") or ("c10d" if endpoint else "static")
    notes = (f"launch convention: torchrun PET_* variables (PET_NNODES={nnodes})",)
    if backend == "static":
        args, out_env, host = _static(env, lo, hi, timings)
    else:
        args, out_env, host = _dynamic(env, lo, hi, backend, endpoint, timings)
    local = env.get("PET_LOCAL_ADDR") or env.get("TRAIN_LOCAL_ADDR")
    if local:
        args += ["--local-addr", local]
    job = env.get("PET_RDZV_ID") or (f"static:{env.get('PET_MASTER_ADDR')}:"
                                      f"{env.get('PET_MASTER_PORT')}" if hi > 1 else None)
    restarts = _int(env, "MAX_RESTARTS")
    if restarts is None and backend == "static" and hi > 1:
        restarts = 0  # static: a restart cannot bring back a lost node; exit promptly
    store = None
    if backend != "static" and env.get("PET_RDZV_ENDPOINT") and hi > 1:
        where = parse_endpoint(env.get("PET_RDZV_ENDPOINT"), "PET_RDZV_ENDPOINT")
        store = f"{where[0]}:{where[1]}"
    heartbeat = None
    if backend == "static" and env.get("PET_MASTER_PORT"):
        heartbeat = heartbeat_of(env.get("PET_MASTER_ADDR"),
                                 parse_port(env.get("PET_MASTER_PORT"), "PET_MASTER_PORT"),
                                 _int(env, "NODE_RANK"), hi)
    return Nodes(NAME, lo, hi, tuple(args), out_env, host, max_restarts=restarts,
                 nproc=_nproc(env), job=job, store=store, static=backend == "static",
                 heartbeat=heartbeat, notes=notes)


def _static(env: Environ, lo: int, hi: int, timings: Timings
            ) -> tuple[list[str], dict[str, str], str | None]:
    addr, port = env.get("PET_MASTER_ADDR"), env.get("PET_MASTER_PORT")
    rank = _int(env, "NODE_RANK")
    if hi > 1 and (not addr or rank is None):
        raise env_error("PET_MASTER_ADDR" if not addr else "PET_NODE_RANK",
                        "static rendezvous over several nodes needs PET_MASTER_ADDR, "
                        "PET_MASTER_PORT and PET_NODE_RANK (or use c10d with "
                        "PET_RDZV_ENDPOINT)")
    args = static_rendezvous(lo, hi, rank=rank, addr=addr,
                             port=parse_port(port, "PET_MASTER_PORT") if port else None,
                             timings=timings)
    return args, {}, addr if (hi > 1 and rank != 0) else None


def _dynamic(env: Environ, lo: int, hi: int, backend: str, endpoint: str | None,
             timings: Timings) -> tuple[list[str], dict[str, str], str | None]:
    conf = parse_rdzv_conf(env.get("PET_RDZV_CONF") or "", "PET_RDZV_CONF")
    if hi > 1 and not endpoint:
        raise env_error("PET_RDZV_ENDPOINT", f"required for {backend} rendezvous over "
                                             f"{lo}:{hi} nodes: host:port of the store")
    where = parse_endpoint(endpoint, "PET_RDZV_ENDPOINT") if endpoint else None
    run_id = env.get("PET_RDZV_ID")
    if not run_id and conf.get("is_host", "").lower() in ("false", "0"):
        raise env_error("PET_RDZV_ID", "required with a standalone rendezvous store "
                                       "(is_host=false): use a value unique to the job, e.g. "
                                       "its uid; the default 'none' makes the store refuse new "
                                       "nodes (RendezvousClosedError)")
    args, out_env = dynamic_rendezvous(lo, hi, backend=backend, endpoint=where, run_id=run_id,
                                       user_conf=conf, re_rendezvous=hi > 1, timings=timings)
    return args, out_env, where[0] if where and hi > 1 else None
