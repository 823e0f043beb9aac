"""A credential never reaches a file, a log line, argv, a checkpoint or a tracker.

A unique secret is planted in every config key that could carry one (refused: exit 2,
one line each, the secret not echoed, nothing written) and in every environment
variable that carries one (a tracking URI with user and password, MLflow's and W&B's own
variables, tokens the user's code would read). A run on two ranks under torchrun, its
resume and an export then train and track with them, and every secret is looked for in
everything they wrote: the whole run directory (checkpoints byte for byte), the console,
the home and temporary folders, the trackers' stores (a real ``mlflow server``'s SQLite
store, artifacts and log, and W&B's offline files, when ``make trackers`` installed
them), and the command line of every process of the run, read from /proc while it ran.
A run directory an older version left with a password in its config.yaml resumes with
the password shown as ``***`` and gone from the rewritten file. In process:
tests/unit/test_credentials.py.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from tests.harness import procs
from tests.harness.mlflowserver import mlflow_server
from tests.harness.runs import ENTRY, TINY_MLP, clean_env, installed, limit, merge, write_config


def planted(name: str) -> str:
    """A secret no run could produce by chance, named for where it was planted."""
    return f"planted{name}{secrets.token_hex(10)}"


def watched(args: list[str], cwd: Path, env: dict, seen: dict[int, str]
            ) -> subprocess.CompletedProcess:
    """``entrypoint.py ARGS``, with the command line of every process below it recorded
    in ``seen`` (pid -> argv) every 0.1 s while it runs (and -pid for a worker that has
    the planted WANDB_API_KEY in its environment)."""
    proc = subprocess.Popen([sys.executable, ENTRY, *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for pid in {proc.pid} | procs.descendants(proc.pid):
                line = procs.cmdline(pid)
                if line:
                    seen[pid] = line
                if "train.worker" in line and "WANDB_API_KEY" in procs.environ(pid):
                    seen[-pid] = "(a worker with the secrets in its environment)"
            time.sleep(0.1)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out, err = proc.communicate(timeout=limit(300))
    finally:
        done.set()
        watcher.join()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def everything_written(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file() and not p.is_symlink()}


def test_keys_refuse_credentials_and_the_environments_never_leak(tmp_path):
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    runs = tmp_path / "runs"
    # 1. every config key that could carry a credential, with one: refused before anything
    in_keys = {k: planted(k.replace(".", "")) for k in (
        "tracking_uri", "data_path", "model_args", "data_args", "query")}
    config = write_config(tmp_path / "keys.yaml", merge(TINY_MLP, {
        "output": {"dir": str(runs)},
        "logging": {"mlflow": {"tracking_uri": f"http://me:{in_keys['tracking_uri']}@mlflow:5000"}},
    }))
    typed: dict[int, str] = {}
    refused = watched(["train", str(config),
                       f"data.path=s3://bucket/data.bin?X-Amz-Signature={in_keys['data_path']}",
                       f"model.args.hf_token={in_keys['model_args']}",
                       f"data.args={{db: {{password: {in_keys['data_args']}}}}}",
                       f"logging.wandb.project=https://host/p?access_token={in_keys['query']}"],
                      tmp_path, clean_env(HOME=str(home), TMPDIR=str(tmp)), typed)
    assert refused.returncode == 2, refused.stderr[-3000:]
    errors = refused.stderr.splitlines()
    for key in ("logging.mlflow.tracking_uri", "data.path", "model.args.hf_token",
                "data.args.db.password", "logging.wandb.project"):
        (line,) = [e for e in errors if f": {key}: " in e]
        assert line.startswith("error: ") and \
            ("environment variable" in line or "MLFLOW_TRACKING_PASSWORD" in line), line
    assert not runs.exists(), "nothing is written for a refused config"
    # the command the user typed has them, for the moment it takes to refuse; nothing else
    assert [line for line in typed.values() if any(s in line for s in in_keys.values())] == \
        [f"{sys.executable} {ENTRY} {' '.join(refused.args[2:])}"]

    # 2. the credentials where they belong, in the environment: a run, its resume, an export
    user, password = planted("uriuser"), planted("uripassword")
    in_env = {"MLFLOW_TRACKING_USERNAME": planted("mlflowuser"),
              "MLFLOW_TRACKING_PASSWORD": planted("mlflowpassword"),
              "MLFLOW_TRACKING_TOKEN": planted("mlflowtoken"),
              "WANDB_API_KEY": secrets.token_hex(20),  # W&B checks the length: 40
              "HF_TOKEN": planted("hftoken"), "AWS_SECRET_ACCESS_KEY": planted("aws")}
    seen: dict[int, str] = {}
    trackers = {}
    tracked = installed("mlflow") and installed("wandb")
    with _server(tmp_path / "mlflow", tracked) as uri:
        host = uri.split("//", 1)[1] if uri else "127.0.0.1:9"
        env = clean_env(HOME=str(home), TMPDIR=str(tmp), OMP_NUM_THREADS="1",
                        MLFLOW_TRACKING_URI=f"http://{user}:{password}@{host}", **in_env)
        if tracked:
            trackers = {"mlflow": {"enabled": True, "experiment": "credentials"},
                        "wandb": {"mode": "offline", "project": "credentials"}}
        config = write_config(tmp_path / "creds.yaml", merge(TINY_MLP, {
            "output": {"dir": str(runs)}, "checkpoint": {"every_steps": 3},
            "distributed": {"nproc_per_node": 2}, "logging": trackers}))
        first = watched(["train", str(config), "train.max_steps=6"], tmp_path, env, seen)
        assert first.returncode == 0, first.stderr[-3000:]
        run_dir = runs / "creds"
        # an older version saved a tracking URI with its password in config.yaml
        legacy = planted("legacy")
        saved = yaml.safe_load((run_dir / "config.yaml").read_text())
        saved["logging"]["mlflow"]["tracking_uri"] = f"http://old:{legacy}@127.0.0.1:9"
        (run_dir / "config.yaml").write_text(yaml.safe_dump(saved))
        second = watched(["train", str(config), "train.max_steps=10"], tmp_path, env, seen)
        assert second.returncode == 0, second.stderr[-3000:]
        exported = watched(["export", str(run_dir)], tmp_path, env, seen)
        assert exported.returncode == 0, exported.stderr[-3000:]

    # the story happened: both ranks trained under torchrun to step 10, tracked
    result = yaml.safe_load((run_dir / "result.json").read_text())
    assert result["step"] == 10
    workers = [line for line in seen.values() if "train.worker" in line]
    assert workers and any("launcher.torchrun" in line for line in seen.values())
    assert [pid for pid in seen if pid < 0], "the workers had the secrets to leak"
    (warning,) = [ln for ln in second.stderr.splitlines() if "resuming" in ln]
    assert "logging.mlflow.tracking_uri http://***@127.0.0.1:9 -> null" in warning, warning
    if tracked:
        assert f"http://***@{host}" in (run_dir / "trackers.json").read_text()
        assert "uploaded to MLflow run" in exported.stdout
        assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))

    # 3. no secret anywhere: output, argv, files (the run's, the trackers', home and tmp)
    said = "".join(p.stdout + p.stderr for p in (refused, first, second, exported))
    argv = "\n".join(seen.values())
    files = {p: data for p, data in everything_written(tmp_path).items()
             if p != tmp_path / "keys.yaml"}  # the refused config, as the test wrote it
    assert len([p for p in files if "checkpoints" in p.parts]) > 2
    for name, secret in {**in_keys, **in_env, "uriuser": user, "uripassword": password,
                         "legacy": legacy}.items():
        assert secret not in said, f"{name} printed"
        assert secret not in argv, f"{name} in a command line"
        leaked = [str(p.relative_to(tmp_path)) for p, data in files.items()
                  if secret.encode() in data]
        assert not leaked, f"{name} written to {leaked}"


def _server(home: Path, wanted: bool):
    """The local MLflow server when the trackers are installed, else no URI."""
    import contextlib
    if not wanted:
        return contextlib.nullcontext(None)
    home.mkdir()
    return mlflow_server(home)
