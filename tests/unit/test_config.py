"""Config contract: strict keys, typed values, one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.harness.runs import ROOT, TINY_GPT, TINY_MLP, limit, merge, worker_env, write_config
from train.core.config import AUTO, Config, batch_split, load_config, parse_override, reference
from train.core.errors import ConfigError

# (name, config tree or None for "file missing" / raw text, overrides, expected key, fragment)
ERROR_CASES = [
    ("unknown top-level key", merge(TINY_GPT, {"sead": 1}), [], "sead", "did you mean seed?"),
    ("unknown nested key", merge(TINY_GPT, {"model": {"widht": 3}}), [], "model.widht",
     "did you mean model.width?"),
    ("wrong type", merge(TINY_GPT, {"train": {"max_steps": "ten"}}), [], "train.max_steps",
     "expected an integer"),
    ("bool is not an int", merge(TINY_GPT, {"train": {"max_steps": True}}), [], "train.max_steps",
     "expected an integer"),
    ("out of range", merge(TINY_GPT, {"optim": {"lr": -1.0}}), [], "optim.lr", "must be > 0.0"),
    ("not in enum", merge(TINY_GPT, {"precision": "fp8"}), [], "precision",
     "one of fp32, bf16, fp16"),
    ("section given a value", merge(TINY_GPT, {"model": 3}), [], "model", "must be a mapping"),
    ("heads do not divide width", merge(TINY_GPT, {"model": {"heads": 3}}), [], "model.heads",
     "does not divide"),
    ("gpt on image data", merge(TINY_GPT, {"data": {"kind": "synthetic"}}), [], "data.kind",
     "needs text, tokens or custom"),
    ("micro batch does not divide", TINY_GPT, ["train.micro_batch_size=3"],
     "train.micro_batch_size", "does not divide"),
    ("tensors without a path", merge(TINY_MLP, {"data": {"kind": "tensors"}}), [], "data.path",
     "required"),
    ("tensors file missing", merge(TINY_MLP, {"data": {"kind": "tensors", "path": "/nope.pt"}}),
     [], "data.path", "no such file"),
    ("text dir missing", merge(TINY_GPT, {"data": {"path": "/no/such/dir"}}), [], "data.path",
     "/no/such/dir: no such file"),
    ("cpu offload without fsdp", merge(TINY_GPT, {"memory": {"cpu_offload": True}}), [],
     "memory.cpu_offload", "fsdp"),
    ("betas out of range", merge(TINY_GPT, {"optim": {"betas": [0.9, 1.5]}}), [], "optim.betas",
     "two numbers in [0, 1)"),
    ("override without =", TINY_GPT, ["train.max_steps"], "train.max_steps", "dotted.key=value"),
    ("override unknown key", TINY_GPT, ["optim.lrate=1"], "optim.lrate",
     "did you mean optim.lr"),
    ("override below a value", TINY_GPT, ["seed.x=1"], "seed", "is a value, not a section"),
    ("override wrong type", TINY_GPT, ["optim.lr=fast"], "optim.lr", "expected a number"),
    ("bad run name", TINY_GPT, ["run.name=a/b"], "run.name", "without '/'"),
    ("resume from a missing checkpoint", TINY_GPT, ["checkpoint.resume_from=/no/step-3"],
     "checkpoint.resume_from", "not a checkpoint directory"),
    ("cross-key check caused by an override", TINY_GPT, ["model.heads=3"], "model.heads",
     "3 does not divide model.width=32 ("),
    ("activation checkpointing on mlp", merge(TINY_MLP, {"memory": {
        "activation_checkpointing": "full"}}), [], "memory.activation_checkpointing", "gpt"),
]


def _run(config: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "train", str(config), *args], cwd=ROOT,
                          env=worker_env(env), capture_output=True, text=True, timeout=limit(120))


def assert_one_line_error(proc: subprocess.CompletedProcess, source: str, key: str,
                          fragment: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    prefix = f"error: {source}: " if key == "<file>" else f"error: {source}: {key}: "
    assert lines[0].startswith(prefix) and "<file>" not in lines[0], lines[0]
    assert fragment in lines[0]


@pytest.mark.parametrize("name,tree,overrides,key,fragment", ERROR_CASES,
                         ids=[c[0] for c in ERROR_CASES])
def test_config_errors_exit_2_with_one_line(tmp_path, name, tree, overrides, key, fragment):
    runs = tmp_path / "runs"
    config = write_config(tmp_path / "bad.yaml", merge(tree, {"output": {"dir": str(runs)}}))
    proc = _run(config, *overrides)
    source = "command line" if overrides else str(config)
    assert_one_line_error(proc, source, key, fragment)
    assert not runs.exists(), "a rejected config must not write anything"


@pytest.mark.parametrize("text,key,fragment", [
    ("model: [unclosed", "line 1", "invalid YAML"),
    ("- a\n- b\n", "<top>", "must hold a mapping"),
])
def test_unparsable_files(tmp_path, text, key, fragment):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    assert_one_line_error(_run(config), str(config), key, fragment)


def test_missing_config_file(tmp_path):
    missing = tmp_path / "absent.yaml"
    assert_one_line_error(_run(missing), str(missing), "<file>", "no such file")


def test_tokens_file_with_odd_size(tmp_path):
    bad = tmp_path / "tok.bin"
    bad.write_bytes(b"\x01\x02\x03")
    config = write_config(tmp_path / "c.yaml", merge(TINY_GPT, {"data": {"kind": "tokens",
                                                                         "path": str(bad)}}))
    assert_one_line_error(_run(config), str(config), "data.path", "not a uint16 token file")


def test_pickled_object_in_pt_file_is_rejected(tmp_path):
    """weights_only loading: a .pt holding arbitrary objects is bad input, not code to run."""
    import torch
    blob = tmp_path / "evil.pt"
    torch.save({"features": torch.zeros(4, 2), "labels": torch.zeros(4).long(),
                "x": ConfigError("a", "b", "c")}, blob)
    config = write_config(tmp_path / "c.yaml", merge(TINY_MLP, {
        "data": {"kind": "tensors", "path": str(blob)}, "output": {"dir": str(tmp_path / "r")}}))
    assert_one_line_error(_run(config), str(blob), "data.path", "cannot load")


def test_global_batch_not_divisible_by_world_size_is_bad_input(tmp_path):
    """Checked before joining the process group, so a lone worker does not hang."""
    config = write_config(tmp_path / "c.yaml", merge(TINY_GPT, {"output": {"dir": str(tmp_path)}}))
    proc = _run(config, env={"WORLD_SIZE": "3", "RANK": "0", "LOCAL_RANK": "0",
                             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    assert_one_line_error(proc, str(config), "train.global_batch_size",
                          "not divisible by world size 3")


def test_overrides_are_typed(tmp_path):
    config = write_config(tmp_path / "c.yaml", TINY_GPT)
    cfg = load_config(config, ["optim.lr=3e-4", "optim.betas=[0.8, 0.99]", "run.name=2024",
                               "train.micro_batch_size=auto", "deterministic=true",
                               "data.path=null", "model.dropout=0"])
    assert cfg.optim.lr == pytest.approx(3e-4) and isinstance(cfg.optim.lr, float)
    assert cfg.optim.betas == [0.8, 0.99]
    assert cfg.run.name == "2024"
    assert cfg.train.micro_batch_size == AUTO
    assert cfg.deterministic is True
    assert cfg.data.path is None
    assert isinstance(cfg.model.dropout, float)


def test_run_name_defaults_to_config_stem(tmp_path):
    cfg = load_config(write_config(tmp_path / "my-experiment.yaml", TINY_GPT))
    assert cfg.run.name == "my-experiment"


def test_print_config_round_trips(tmp_path):
    config = write_config(tmp_path / "c.yaml", TINY_GPT)
    proc = _run(config, "--print-config", "optim.lr=0.5")
    assert proc.returncode == 0, proc.stderr
    resolved = yaml.safe_load(proc.stdout)
    assert resolved["optim"]["lr"] == 0.5
    assert resolved["run"]["name"] == "c"
    again = write_config(tmp_path / "again.yaml", resolved)
    assert load_config(again) == load_config(config, ["optim.lr=0.5"])


@pytest.mark.parametrize("world,micro,expect", [(1, AUTO, (8, 1)), (2, AUTO, (4, 1)),
                                                (2, 2, (2, 2)), (4, 1, (1, 2))])
def test_batch_split_keeps_global_batch(tmp_path, world, micro, expect):
    cfg = load_config(write_config(tmp_path / "c.yaml", TINY_GPT),
                      [f"train.micro_batch_size={micro}"])
    got = batch_split(cfg, world, "c.yaml")
    assert got == expect
    assert world * got[0] * got[1] == cfg.train.global_batch_size


def test_shipped_configs_load():
    configs = sorted((ROOT / "configs").glob("*.yaml"))
    assert {"quickstart", "cnn", "gpt-small"} <= {c.stem for c in configs}
    for path in configs:
        assert isinstance(load_config(path), Config)
        assert path.read_text().startswith("#"), f"{path.name} needs a header comment"


def test_schema_file_is_in_sync():
    on_disk = json.loads((ROOT / "configs" / "schema.json").read_text())
    assert on_disk == reference.json_schema(), \
        "regenerate: python -m train.core.config.reference --schema > configs/schema.json"


def test_schema_accepts_shipped_configs_and_rejects_unknown_keys():
    jsonschema = pytest.importorskip("jsonschema")
    schema = reference.json_schema()
    for path in (ROOT / "configs").glob("*.yaml"):
        jsonschema.validate(yaml.safe_load(path.read_text()), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"model": {"widht": 3}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"optim": {"lr": 0}}, schema)


def test_docs_config_reference_is_generated():
    readme = (ROOT / "docs/config.md").read_text()
    begin, end = "<!-- config-reference:begin -->\n", "<!-- config-reference:end -->"
    assert begin in readme and end in readme
    table = readme.split(begin, 1)[1].split(end, 1)[0]
    assert table == reference.markdown(), \
        "regenerate docs/config.md's table: python -m train.core.config.reference --markdown"


def test_parse_override_reads_yaml_values():
    assert parse_override("a.b=[1, 2]") == ("a.b", [1, 2])
    assert parse_override("a=") == ("a", "")
    with pytest.raises(ConfigError):
        parse_override("=3")


def test_token_ids_beyond_vocab_size_are_bad_input(tmp_path):
    import numpy as np
    path = tmp_path / "t.bin"
    (np.arange(4000) % 700).astype(np.uint16).tofile(path)
    config = write_config(tmp_path / "c.yaml", merge(TINY_GPT, {
        "data": {"kind": "tokens", "path": str(path), "vocab_size": 500}}))
    assert_one_line_error(_run(config), str(config), "data.vocab_size", "token id 699")


def test_a_failing_worker_exits_1_with_one_line_naming_its_rank(tmp_path):
    """Valid config, but the data does not fit the model: fails inside training."""
    import torch
    torch.save({"features": torch.randn(64, 3), "labels": torch.arange(64) % 2}, tmp_path / "d.pt")
    config = write_config(tmp_path / "c.yaml", merge(TINY_MLP, {
        "model": {"kind": "cnn"}, "data": {"kind": "tensors", "path": str(tmp_path / "d.pt")},
        "output": {"dir": str(tmp_path / "runs")}}))
    proc = _run(config)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last == "error: rank 0: ValueError: model.kind cnn needs samples shaped " \
                   "[channels, height, width], got [3]", last
    assert "Traceback" in proc.stderr, "the details belong in the rank's log"
