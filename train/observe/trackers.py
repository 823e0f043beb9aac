"""Experiment trackers beside TensorBoard: MLflow and Weights & Biases, both optional.

Neither is a dependency: ``pip install mlflow-skinny`` or ``wandb`` (the extras
``trainpod[mlflow]`` and ``trainpod[wandb]``) adds one, and the config turns it on
(``logging.mlflow.enabled``, ``logging.wandb.mode``). The launcher checks that the
package is there before anything starts (exit 3 with the install command), and rank 0
alone talks to the tracker.

One training run is one tracker run, however often it is resumed: the tracker's run id
is kept in ``RUN_DIR/trackers.json``, written before the first metric, and a resumed or
restarted attempt continues that run (MLflow: the same run, set back to RUNNING; W&B:
``resume="allow"`` with the same id). MLflow's metric history is append-only, so the
steps between the last checkpoint and a crash appear twice there (the lost attempt's
and the rerun's); metrics.jsonl and TensorBoard keep only the rerun's.

A tracker is an observer, never a reason to lose training, nor to hold a run's end:
failing to start one ends the launch with one line (exit 3: the server is unreachable,
the URI is wrong). After that every call goes through a bounded buffer on a thread of
its own (train/observe/sender.py): a server that restarts or vanishes mid-run is one
warning when it stops answering and one when it answers again, its metrics kept
meanwhile; at the run's end the buffer and the run's close get what is left of
``train.shutdown_timeout_s``. MLflow's client is made to give up on a call within
seconds (MLFLOW_CALL_DEFAULTS: its own default retries a call for minutes), and
urllib3's "Retrying ..." warning for every retried call stays off the console.

Upstream: https://mlflow.org/docs/latest/api_reference/python_api/mlflow.client.html,
https://docs.wandb.ai/ref/python/sdk/functions/init/.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import json
import logging
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

from train.core.config import Config
from train.core.config.tracking import MLFLOW_URI_VAR, mlflow_uri, said, shown_uri, wanted
from train.core.errors import CannotRunHere
from train.core.files import write_json_atomic
from train.core.run import rundir
from train.observe.sender import Row, Sender

log = logging.getLogger("train")

RECORD = rundir.TRACKERS  # in the run directory: which tracker runs this run continues
# MLflow's limits for a param (mlflow/utils/validation.py): these characters, key 250,
# value 6000 characters
PARAM_KEY = re.compile(r"[^\w\-. /]")
MAX_PARAM_KEY, MAX_PARAM_VALUE = 250, 6000
# MLflow's client retries a failed call 7 times with a doubling pause (minutes against a
# server that is gone) and waits 120 s for an answer; the sender retries by itself, so a
# call gives up within seconds. A value the user set in the environment wins.
MLFLOW_CALL_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
                        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                        "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}
START_FAILED_CLOSE_S = 10.0  # closing the runs already started when another fails to start


def mlflow_params(params: dict[str, Any]) -> dict[str, str]:
    """Params as MLflow takes them: allowed characters only, keys and values cut to its
    limits."""
    return {PARAM_KEY.sub("_", k)[:MAX_PARAM_KEY]: str(v)[:MAX_PARAM_VALUE]
            for k, v in params.items()}


def mlflow_client(uri: str):
    """An MlflowClient whose calls give up within seconds (MLFLOW_CALL_DEFAULTS) and
    whose retries stay off the console."""
    for name, value in MLFLOW_CALL_DEFAULTS.items():
        os.environ.setdefault(name, value)
    # one "Retrying (Retry(total=...)) after connection broken" warning per retried call:
    # 65 lines for one server restart; the sender says it in two
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    from mlflow import MlflowClient
    return MlflowClient(uri)


def read_record(run_dir: Path) -> dict:
    try:
        record = json.loads((run_dir / RECORD).read_text())
        return record if isinstance(record, dict) else {}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("%s unreadable (%s): the trackers start new runs", run_dir / RECORD, exc)
        return {}


class MlflowRun:
    """One MLflow run through the client API (no global active run)."""

    name = "MLflow"

    def __init__(self, cfg: Config, run_dir: Path, params: dict[str, Any], previous: dict):
        self.uri = mlflow_uri(cfg)
        self.client = mlflow_client(self.uri)
        same_server = previous.get("tracking_uri") == shown_uri(self.uri)
        run = self._continue(previous["run_id"]) if same_server and "run_id" in previous \
            else None
        if run is None:
            experiment_id = self._experiment(cfg.logging.mlflow.experiment
                                             or os.environ.get("MLFLOW_EXPERIMENT_NAME"))
            run = self.client.create_run(experiment_id, run_name=cfg.run.name,
                                         tags={"trainpod.run_dir": str(run_dir.resolve())})
        self.run_id, self.experiment_id = run.info.run_id, run.info.experiment_id
        self.record = {"tracking_uri": shown_uri(self.uri), "run_id": self.run_id,
                       "experiment_id": self.experiment_id}
        self._log_params(params, run.data.params)

    def _continue(self, run_id: str):
        from mlflow.exceptions import MlflowException
        try:
            run = self.client.get_run(run_id)
        except MlflowException as exc:
            log.warning("MLflow run %s not found (%s): starting a new one", run_id,
                        said(exc, 200))
            return None
        self.client.update_run(run_id, status="RUNNING")
        return run

    def _experiment(self, name: str | None) -> str:
        from mlflow.exceptions import MlflowException
        if not name:
            return "0"  # MLflow's Default experiment
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name)
        except MlflowException:  # another job created it first
            return self.client.get_experiment_by_name(name).experiment_id

    def _log_params(self, params: dict[str, Any], logged: dict[str, str]) -> None:
        """MLflow keeps a param's first value for good: a resume logs only new keys and
        names the changed ones. Keys and values are made to fit MLflow's rules (a custom
        model's ``model.args`` may hold any name), so that no param can refuse a run."""
        from mlflow.entities import Param
        params = mlflow_params(params)
        new = {k: v for k, v in params.items() if k not in logged}
        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
        if changed:
            log.warning("MLflow keeps a param's first value; changed since then: %s",
                        ", ".join(changed[:5]) + (", ..." if len(changed) > 5 else ""))
        items = [Param(k, v) for k, v in new.items()]
        for i in range(0, len(items), 100):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def send_rows(self, rows: list[Row]) -> None:
        """Metric rows in one call (the sender's thread: it may wait on the server)."""
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[
            Metric(k, float(v), now, step) for step, values in rows for k, v in values.items()])

    @staticmethod
    def refused(exc: BaseException) -> bool:
        """A 4xx answer (the run is gone, a value it will never take, credentials no
        longer valid): retrying cannot help. No answer, a 5xx, 408 or 429: an outage."""
        status = getattr(exc, "get_http_status_code", lambda: 500)()
        return 400 <= status < 500 and status not in (408, 429)

    def artifact(self, path: Path, folder: str | None = None) -> None:
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), folder)
        else:
            self.client.log_artifact(self.run_id, str(path), folder)

    def link(self) -> str:
        return f"{shown_uri(self.uri).rstrip('/')}/#/experiments/{self.experiment_id}" \
               f"/runs/{self.run_id}"

    def close(self, status: str) -> None:
        with contextlib.redirect_stdout(io.StringIO()):  # its own "View run" lines
            self.client.set_terminated(self.run_id, status)


class WandbRun:
    """One W&B run; ``offline`` writes RUN_DIR/wandb/offline-run-*/ for ``wandb sync``."""

    name = "W&B"

    def __init__(self, cfg: Config, run_dir: Path, params: dict[str, Any], previous: dict):
        import wandb
        self.mode, self.run_dir = cfg.logging.wandb.mode, run_dir
        run_id = previous.get("id") or secrets.token_hex(4)
        self.record = {"id": run_id}
        self.run = wandb.init(
            project=cfg.logging.wandb.project or os.environ.get("WANDB_PROJECT"),
            name=cfg.run.name, id=run_id, resume="allow", mode=self.mode, dir=str(run_dir),
            config=params,
            # the console stays ours (W&B would wrap stdout); its own lines go to its logs
            settings=wandb.Settings(console="off", silent=True))

    def send_rows(self, rows: list[Row]) -> None:
        for step, values in rows:
            self.run.log(values, step=step)

    @staticmethod
    def refused(exc: BaseException) -> bool:
        """Only a communication error is an outage (online mode); anything else (a
        usage error, a full disk in offline mode) will not pass on a retry."""
        import wandb.errors
        return not isinstance(exc, wandb.errors.CommError)

    def artifact(self, path: Path, folder: str | None = None) -> None:
        pass  # W&B artifacts need a project on a server; the run's files name the export

    def link(self) -> str:
        if self.mode == "offline":
            return f"offline: wandb sync {Path(self.run.dir).parent}"
        return self.run.url or ""

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


KINDS = {"mlflow": MlflowRun, "wandb": WandbRun}


class Trackers:
    """The trackers a config asks for (rank 0 only), each behind its own sender."""

    def __init__(self, cfg: Config, run_dir: Path, params: dict[str, Any]):
        self.runs: dict[str, Any] = {}
        self.senders: dict[str, Sender] = {}
        self.closed_lines: list[str] = []
        record = read_record(run_dir)
        for kind in wanted(cfg):
            try:
                run = KINDS[kind](cfg, run_dir, params, record.get(kind) or {})
            except Exception as exc:  # the tracker's own errors: one line, exit 3
                self.close("FAILED", _seconds_from_now(START_FAILED_CLOSE_S))
                where = f" at {shown_uri(mlflow_uri(cfg) or '')}" if kind == "mlflow" else ""
                raise CannotRunHere(
                    f"{KINDS[kind].name}{where} could not start a run: "
                    f"{said(exc)}; check the server and its "
                    f"credentials, or turn it off in logging.{kind}") from None
            self.runs[kind] = run
            self.senders[kind] = Sender(run.name, run.send_rows, run.refused)
            record[kind] = run.record
            write_json_atomic(run_dir / RECORD, record)

    def log(self, step: int, values: dict[str, float]) -> None:
        """Hands the row over; never waits on a server."""
        for sender in self.senders.values():
            sender.metrics(step, values)

    def artifact(self, path: Path, folder: str | None = None) -> None:
        for kind, sender in self.senders.items():
            sender.call(f"uploading {path.name}",
                        functools.partial(self.runs[kind].artifact, path, folder))

    def lines(self) -> list[str]:
        """The summary's lines: where each run is (also after close); a tracker that
        refused a call is left out."""
        return self.closed_lines or [f"  {run.name:<14} {run.link()}"
                                     for kind, run in self.runs.items()
                                     if self.senders[kind].running]

    def close(self, status: str, seconds_left) -> list[str]:
        """status: FINISHED, FAILED or KILLED (MLflow's words). Sends what waits and
        closes each run while ``seconds_left()`` is above 0; returns what was abandoned
        (one entry per tracker that did not finish)."""
        self.closed_lines = self.lines()
        for kind, sender in self.senders.items():  # every close queued, then the waits
            sender.close(functools.partial(self.runs[kind].close, status))
        abandoned = [left for sender in self.senders.values()
                     if (left := sender.wait(seconds_left))]
        self.runs.clear()
        self.senders.clear()
        return abandoned


def _seconds_from_now(seconds: float):
    until = time.monotonic() + seconds
    return lambda: until - time.monotonic()


def upload_export(run_dir: Path, out: Path) -> str | None:
    """After ``export``: the export's files as artifacts (``export/``) of the training
    run's MLflow run, when it had one. Returns what to tell the user; the export itself
    never fails for it."""
    import yaml
    previous = read_record(run_dir).get("mlflow")
    try:
        logged = yaml.safe_load((run_dir / rundir.CONFIG).read_text())["logging"]["mlflow"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        logged = None
    if not previous or not logged or not logged.get("enabled"):
        return None
    uri = logged.get("tracking_uri") or os.environ.get(MLFLOW_URI_VAR)
    if not uri or importlib.util.find_spec("mlflow") is None:
        return (f"warning: not uploaded to MLflow run {previous.get('run_id')}: "
                + ("no tracking URI (set MLFLOW_TRACKING_URI)" if not uri
                   else "mlflow is not installed here"))
    try:
        mlflow_client(uri).log_artifacts(previous["run_id"], str(out), rundir.EXPORT)
    except Exception as exc:  # MLflow's, requests' or the OS's: the export stands
        return f"warning: MLflow upload failed ({said(exc, 200)})"
    return f"uploaded to MLflow run {previous['run_id']} (artifacts: export/)"
