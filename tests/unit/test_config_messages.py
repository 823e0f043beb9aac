"""A new user's first hour with the config: what the messages say, through the real
commands (``entrypoint.py`` and ``python -m train`` as subprocesses).

- a warmup longer than the run is shortened to it, with one warning line, and the
  schedule really uses the shortened warmup;
- every value an error or warning quotes says where it came from (the file, the
  command line, or the default);
- a missing config gets a "did you mean", and so does a misspelt allowed value;
- ``--optim.lr=1e-3`` (an override written as an option) gets a one-line hint;
- ``--help-config`` lists every key of the schema;
- every problem of a config is reported at once, one line each.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.harness.runs import (
    ENTRY,
    ROOT,
    TINY_GPT,
    clean_env,
    limit,
    merge,
    read_metrics,
    worker_env,
    write_config,
)
from train.core.config import Config, types

QUICKSTART = "configs/quickstart.yaml"


def entry(*args: str, cwd: Path = ROOT, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, ENTRY, *args], cwd=cwd, env=clean_env(),
                          capture_output=True, text=True, timeout=limit(timeout))


def worker(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "train", *args], cwd=cwd, env=worker_env(),
                          capture_output=True, text=True, timeout=limit(120))


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """The error lines of a rejected input: exit 2, nothing else on stderr."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines and all(line.startswith("error: ") for line in lines), proc.stderr
    return lines


# ------------------------------------------------------- warmup longer than the run

def test_warmup_longer_than_the_run_is_shortened_with_one_warning(tmp_path):
    """20 warmup steps in the file, 10 steps on the command line: trains, warns once,
    and the learning rate reaches optim.lr at the last step (warmup = 10)."""
    runs = tmp_path / "runs"
    config = write_config(tmp_path / "c.yaml", merge(TINY_GPT, {
        "schedule": {"warmup_steps": 20, "name": "constant"}, "output": {"dir": str(runs)},
        "checkpoint": {"every_steps": 0}}))
    proc = entry("train", str(config), "train.max_steps=10", cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    warnings = [line for line in output.splitlines() if "warmup shortened" in line]
    assert warnings == [f"entrypoint: warning: {config}: schedule.warmup_steps: 20 exceeds "
                        "train.max_steps=10 (command line); warmup shortened to 10 steps "
                        "(the whole run)"], output[-3000:]
    rows = [r for r in read_metrics(runs / "c") if "lr" in r]
    lr = TINY_GPT["optim"]["lr"]
    assert [r["step"] for r in rows] == list(range(1, 11))
    for r in rows:  # linear warmup over 10 steps, not 20
        assert r["lr"] == pytest.approx(lr * r["step"] / 10), rows
    resolved = yaml.safe_load((runs / "c" / "config.yaml").read_text())
    assert resolved["schedule"]["warmup_steps"] == 10


def test_print_config_shows_the_warmup_used_and_the_worker_warns_once(tmp_path):
    proc = worker(str(ROOT / QUICKSTART), "train.max_steps=10", "--print-config")
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["schedule"]["warmup_steps"] == 10
    assert proc.stderr.strip().splitlines() == [
        f"warning: {ROOT / QUICKSTART}: schedule.warmup_steps: 20 exceeds train.max_steps=10 "
        "(command line); warmup shortened to 10 steps (the whole run)"]


def test_the_dry_run_shows_the_warning(tmp_path):
    proc = entry("train", QUICKSTART, "train.max_steps=10", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert (f"# warning: {QUICKSTART}: schedule.warmup_steps: 20 exceeds train.max_steps=10 "
            "(command line); warmup shortened to 10 steps") in proc.stdout


# ------------------------------------------------------------- where values came from

@pytest.mark.parametrize("in_file, overrides, source, expect", [
    ({"model": {"heads": 3, "width": 32}}, ["model.width=64"], "{config}",
     "model.heads: 3 does not divide model.width=64 (command line)"),
    ({"model": {"heads": 2, "width": 32}}, ["model.heads=3"], "command line",
     "model.heads: 3 does not divide model.width=32 ({config})"),
    ({"model": {"heads": 3}}, [], "{config}",
     "model.heads: 3 does not divide model.width=128 (default)"),
    ({"model": {"heads": 2}}, ["memory.cpu_offload=true"], "command line",
     "memory.cpu_offload: needs distributed.strategy=fsdp, got distributed.strategy=ddp "
     "(default)"),
    ({"model": {"kind": "mlp"}}, ["data.kind=text"], "command line",
     "data.kind: text data needs model.kind gpt, custom or hf, got model.kind=mlp ({config})"),
    ({"model": {"heads": 2}}, ["data.shuffle=blocks"], "command line",
     "data.shuffle: blocks orders the files of data.kind=tokens; data.kind=text ({config}) "
     "is shuffled by windows"),
])
def test_a_cross_key_error_says_where_each_value_came_from(tmp_path, in_file, overrides,
                                                           source, expect):
    tree = {k: v for k, v in TINY_GPT.items() if k != "model"} | in_file
    tree["output"] = {"dir": str(tmp_path / "runs")}
    config = write_config(tmp_path / "c.yaml", tree)
    line, = error_lines(entry("train", str(config), *overrides, cwd=tmp_path))
    assert line == f"error: {source.format(config=config)}: {expect.format(config=config)}"
    assert not (tmp_path / "runs").exists()


def test_a_batch_set_on_the_command_line_is_blamed_on_it(tmp_path):
    line, = error_lines(entry("train", QUICKSTART, "train.global_batch_size=33",
                              "distributed.nproc_per_node=2", "--dry-run"))
    assert line.startswith("error: command line: train.global_batch_size: 33 is not divisible")


# ------------------------------------------------------------------- did you mean

def test_a_missing_config_gets_a_did_you_mean_among_the_shipped_configs():
    line, = error_lines(entry("train", "configs/quickstrat.yaml"))
    assert line == ("error: configs/quickstrat.yaml: no such file; did you mean "
                    "configs/quickstart.yaml?")


def test_a_missing_config_elsewhere_gets_the_shipped_one_by_a_path_that_works(tmp_path):
    line, = error_lines(entry("train", "quickstart", cwd=tmp_path))
    assert line.endswith(f"no such file; did you mean {ROOT / QUICKSTART}?")
    assert Path(line.rsplit(" ", 1)[1].rstrip("?")).is_file()


def test_a_missing_config_gets_a_near_miss_in_its_own_folder(tmp_path):
    (tmp_path / "exp").mkdir()
    write_config(tmp_path / "exp" / "baseline.yaml", TINY_GPT)
    line, = error_lines(worker(str(tmp_path / "exp" / "basline.yaml")))
    assert line.endswith(f"no such file; did you mean {tmp_path / 'exp' / 'baseline.yaml'}?")


def test_no_suggestion_without_a_near_miss(tmp_path):
    line, = error_lines(entry("train", "zzz.yaml", cwd=tmp_path))
    assert line == "error: zzz.yaml: no such file"


def test_a_misspelt_allowed_value_gets_the_nearest_one(tmp_path):
    config = write_config(tmp_path / "c.yaml", merge(TINY_GPT, {"precision": "bf61"}))
    lines = error_lines(entry("train", str(config), "distributed.backend=glo", "device=tpu",
                              "--dry-run"))
    assert lines == [
        f"error: {config}: precision: got 'bf61'; expected one of fp32, bf16, fp16; "
        "did you mean bf16?",
        "error: command line: distributed.backend: got 'glo'; expected one of auto, nccl, "
        "gloo, mpi; did you mean gloo?",
        "error: command line: device: got 'tpu'; expected one of auto, gpu, cpu"]


@pytest.mark.parametrize("config", ["k8s/config.yaml", "k8s/cpu/config.yaml"])
def test_the_kubernetes_config_map_points_at_the_training_config_inside(config):
    line, = error_lines(entry("train", config, "--dry-run"))
    assert line == (f"error: {config}: a Kubernetes ConfigMap, not a training config; the "
                    "training config is its data.config.yaml (kubectl apply mounts it in the "
                    "pods; to train with it here, save that value to a file of its own)")


def test_another_kubernetes_manifest_is_named_as_one(tmp_path):
    (tmp_path / "job.yaml").write_text("apiVersion: batch/v1\nkind: Job\nspec: {}\n")
    line, = error_lines(entry("train", "job.yaml", cwd=tmp_path))
    assert line == "error: job.yaml: a Kubernetes Job, not a training config"


@pytest.mark.parametrize("loss, hint", [("crossentropy", "; did you mean cross_entropy?"),
                                        ("MSE", "; did you mean mse?"), ("zzz", "")])
def test_a_misspelt_built_in_loss_gets_the_nearest_one(tmp_path, loss, hint):
    config = write_config(tmp_path / "c.yaml", merge(TINY_GPT, {"train": {"loss": loss}}))
    line, = error_lines(entry("train", str(config), "--dry-run"))
    assert line == (f"error: {config}: train.loss: got {loss!r}; expected one of cross_entropy, "
                    f"mse, model or an import path like 'package.module:name'{hint}")


# ------------------------------------------------------ --key=value: an override with dashes

HINT = "error: command line: --optim.lr=1e-3: overrides are written optim.lr=1e-3 " \
       "(without dashes)"


@pytest.mark.parametrize("command", [
    [sys.executable, ENTRY, "train", QUICKSTART, "--optim.lr=1e-3"],
    [sys.executable, ENTRY, "train", "--optim.lr=1e-3", QUICKSTART],
    [sys.executable, ENTRY, "doctor", QUICKSTART, "--optim.lr=1e-3"],
    [sys.executable, ENTRY, "launch", "--optim.lr=1e-3", "script.py"],
    [sys.executable, "-m", "train", QUICKSTART, "--optim.lr=1e-3"],
], ids=["train", "train-first", "doctor", "launch", "python-m-train"])
def test_an_override_with_dashes_gets_a_one_line_hint(command):
    proc = subprocess.run(command, cwd=ROOT, env=worker_env(), capture_output=True, text=True,
                          timeout=limit(120))
    assert error_lines(proc) == [HINT]


def test_a_dashed_key_without_a_value_gets_the_hint_too():
    line, = error_lines(entry("train", QUICKSTART, "--train.max_steps", "10"))
    assert line == ("error: command line: --train.max_steps: overrides are written "
                    "train.max_steps=VALUE (without dashes)")


def test_options_that_are_not_config_keys_are_unchanged():
    line, = error_lines(entry("train", QUICKSTART, "--bogus=1"))
    assert line.startswith("error: command line: train: unrecognized arguments: --bogus=1")


# ------------------------------------------------------------------ --help-config

@pytest.mark.parametrize("command", [
    [sys.executable, "-X", "importtime", ENTRY, "train", "--help-config"],
    [sys.executable, "-X", "importtime", "-m", "train", "--help-config"],
], ids=["entrypoint", "python-m-train"])
def test_help_config_lists_every_schema_key(command):
    proc = subprocess.run(command, cwd=ROOT, env=worker_env(), capture_output=True, text=True,
                          timeout=limit(60))
    assert proc.returncode == 0, proc.stderr[-2000:]
    listed = {m.group(1): m.group(2) for m in
              re.finditer(r"^  (\S+)  .*\(default (.*)\)$", proc.stdout, re.M)}
    schema = dict(types.leaves(Config))
    assert list(listed) == list(schema)  # every key, in the schema's order, nothing else
    for dotted, key in schema.items():
        assert listed[dotted] == json.dumps(key.default), dotted
        assert " ".join(key.doc.split()[:4]) in " ".join(proc.stdout.split()), dotted
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()}
    assert "torch" not in imported


def test_help_mentions_help_config():
    proc = entry("--help")
    assert "train --help-config" in proc.stdout


# ------------------------------------------------------------ every problem at once

def test_every_problem_of_a_config_is_reported_at_once(tmp_path):
    runs = tmp_path / "runs"
    config = write_config(tmp_path / "c.yaml", merge(TINY_GPT, {
        "sead": 1,                                  # unknown key
        "train": {"max_steps": "ten"},              # type error
        "model": {"heads": 3},                      # does not divide model.width=32
        "memory": {"cpu_offload": True},            # needs fsdp
        "output": {"dir": str(runs)}}))
    for proc in (entry("train", str(config), "optim.lr=fast", "optim.betas=[0.9, 2]",
                       cwd=tmp_path),
                 worker(str(config), "optim.lr=fast", "optim.betas=[0.9, 2]")):
        lines = error_lines(proc)
        c = str(config)
        assert sorted(lines) == sorted([
            f"error: {c}: sead: unknown key; did you mean seed?",
            f"error: {c}: train.max_steps: got 'ten'; expected an integer",
            "error: command line: optim.lr: got 'fast'; expected a number",
            f"error: {c}: model.heads: 3 does not divide model.width=32",
            "error: command line: optim.betas: got [0.9, 2.0]; two numbers in [0, 1)",
            f"error: {c}: memory.cpu_offload: needs distributed.strategy=fsdp, got "
            "distributed.strategy=ddp (default)",
        ]), proc.stderr
    assert not runs.exists()


def test_a_check_across_keys_does_not_judge_a_value_that_failed_on_its_own(tmp_path):
    """model.width: "wide" fails as a type; heads=3 against the default width would be a
    second, misleading error."""
    config = write_config(tmp_path / "c.yaml", merge(TINY_GPT, {
        "model": {"heads": 3, "width": "wide"}, "schedule": {"warmup_steps": 20},
        "train": {"max_steps": "x"}}))
    proc = worker(str(config))
    assert error_lines(proc) == [
        f"error: {config}: model.width: got 'wide'; expected an integer",
        f"error: {config}: train.max_steps: got 'x'; expected an integer"]
