"""generate: text from an exported byte-level GPT, the real command on a real export."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
import torch

from tests.harness.runs import (
    ROOT,
    TINY_GPT,
    TINY_MLP,
    limit,
    merge,
    run_train,
    worker_env,
    write_config,
)
from train.core.errors import CannotRunHere
from train.export import load_model


def command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "entrypoint.py", "generate", *map(str, args)],
                          cwd=ROOT, env=worker_env(), capture_output=True, text=True,
                          timeout=limit(120))


def trained_export(root, tree) -> object:
    config = write_config(root / "g.yaml", merge(tree, {"output": {"dir": str(root)},
                                                       "train": {"max_steps": 3}}))
    assert run_train(config).returncode == 0
    out = subprocess.run([sys.executable, "entrypoint.py", "export", str(root / "g")],
                         cwd=ROOT, env=worker_env(), capture_output=True, text=True,
                         timeout=limit(120))
    assert out.returncode == 0, out.stderr
    return root / "g"


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    return trained_export(tmp_path_factory.mktemp("gpt"), TINY_GPT)


def test_greedy_text_is_the_models_likeliest_bytes(gpt_run):
    """--temperature 0: each byte the argmax of the exported model's next-byte logits,
    from the last context_length bytes (longer than the context: the window slides)."""
    prompt, count = "import os\n", 40
    out = command(gpt_run, "--prompt", prompt, "--tokens", count, "--temperature", 0)
    assert out.returncode == 0, out.stderr
    model = load_model(gpt_run / "export")
    ids = list(prompt.encode())
    with torch.no_grad():
        for _ in range(count):
            ids.append(int(model(torch.tensor([ids[-16:]]))[0, -1].argmax()))
    assert out.stdout == bytes(ids).decode("utf-8", errors="replace") + "\n"


def test_the_same_seed_gives_the_same_text(gpt_run):
    runs = [command(gpt_run / "export", "--prompt", "def ", "--tokens", 30, "--seed", 7)
            for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr
    assert runs[0].stdout == runs[1].stdout and runs[0].stdout.startswith("def ")


def test_a_run_without_export_and_bad_flags_are_one_line(tmp_path, gpt_run):
    out = command(tmp_path)
    assert out.returncode == 2 and out.stderr.strip() == (
        f"error: command line: RUN_DIR: {tmp_path}: no export here (no model.json in it or "
        f"in its export/): run `entrypoint.py export {tmp_path}` first")
    out = command(gpt_run, "--top-k", 300)
    assert out.returncode == 2 and out.stderr.strip() == \
        "error: command line: --top-k: 300: expected 0..256"


def test_a_model_that_does_not_write_bytes_is_refused(tmp_path):
    run = trained_export(tmp_path, TINY_MLP)
    out = command(run)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == (
        f"error: command line: RUN_DIR: {run / 'export'}: a mlp model with 4 outputs, not "
        "trained to predict the next token; generate writes text from a byte-level causal "
        "language model (256 outputs, trained on data.kind=text: model.kind gpt or hf, or your "
        "own)")


def test_a_damaged_model_json_is_one_line(tmp_path):
    (tmp_path / "model.json").write_text("{not json")
    out = command(tmp_path)
    assert out.returncode == 2 and out.stderr.strip() == (
        f"error: command line: RUN_DIR: {tmp_path / 'model.json'}: not an export's "
        "model.json (JSONDecodeError); export again")


def copied_export(gpt_run, tmp_path):
    export = tmp_path / "export"
    export.mkdir()
    for name in ("model.pt", "model.json"):
        (export / name).write_bytes((gpt_run / "export" / name).read_bytes())
    return export


def refused(export, problem: str) -> str:
    out = command(export)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert out.stderr.startswith(f"error: command line: RUN_DIR: {export / 'model.pt'}")
    assert problem in out.stderr and out.stderr.strip().endswith("; export again")
    return out.stderr


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_model_pt_is_one_line(gpt_run, tmp_path, damage):
    export = copied_export(gpt_run, tmp_path)
    weights = export / "model.pt"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2] if damage == "truncated" else b"\x80garbage" * 99)
    refused(export, ": damaged or not a torch.save file (")


def test_a_model_pt_holding_more_than_tensors_is_one_line(gpt_run, tmp_path):
    export = copied_export(gpt_run, tmp_path)
    torch.save({"tok.weight": argparse.Namespace(code="anything")}, export / "model.pt")
    refused(export, ": holds objects other than tensors, which torch.load(weights_only=True) "
                    "refuses to unpickle")


def test_a_model_json_naming_a_huge_model_is_refused_before_building_it(gpt_run, tmp_path):
    """model.json edited to a model of about 10^16 parameters: its shapes are compared
    with model.pt's before anything is allocated (no MemoryError, at once)."""
    export = copied_export(gpt_run, tmp_path)
    meta = json.loads((export / "model.json").read_text())
    meta["model"].update(width=2**20, depth=1000)
    (export / "model.json").write_text(json.dumps(meta))
    line = refused(export, f" does not fit {export / 'model.json'}: ")
    assert "is missing from model.pt" in line


def test_a_model_larger_than_the_memory_left_is_exit_3(gpt_run, tmp_path, monkeypatch):
    """The model's bytes (its shapes, on the meta device) against the memory left."""
    from train.core.machine import host
    monkeypatch.setattr(host, "available_memory", lambda: 1000)
    with pytest.raises(CannotRunHere, match=r"export: the model needs \d+ MiB, 0 MiB of memory"):
        load_model(copied_export(gpt_run, tmp_path))
