"""export: the newest checkpoint's weights as plain files that rebuild the model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.harness.runs import (
    ROOT,
    TINY_GPT,
    installed,
    limit,
    merge,
    run_train,
    worker_env,
    write_config,
)
from train.core.config import ModelConfig
from train.core.errors import ConfigError
from train.export import load_model, safetensors_io
from train.export.writing import check_output
from train.models import build_model


def test_export_rebuilds_the_trained_model(tmp_path):
    config = write_config(tmp_path / "e.yaml", merge(TINY_GPT, {"output": {"dir": str(tmp_path)},
                                                                "train": {"max_steps": 4}}))
    assert run_train(config).returncode == 0
    run_dir = tmp_path / "e"
    proc = subprocess.run([sys.executable, "entrypoint.py", "export", str(run_dir)], cwd=ROOT,
                          env=worker_env(), capture_output=True, text=True, timeout=limit(120))
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((run_dir / "export" / "model.json").read_text())
    assert meta["step"] == 4 and meta["io"] == {"input_shape": [16], "num_classes": 256}
    state = torch.load(run_dir / "export" / "model.pt", weights_only=True)
    model = build_model(ModelConfig(**meta["model"]), input_shape=tuple(meta["io"]["input_shape"]),
                        num_classes=meta["io"]["num_classes"])
    model.load_state_dict(state)  # strict: every name and shape matches
    ckpt = torch.load(run_dir / "checkpoints" / "step-4" / "state.pt", weights_only=True)
    assert all(torch.equal(state[k], ckpt["model"][k]) for k in state)


def test_export_without_checkpoint_is_exit_3(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "train.export", str(tmp_path)], cwd=ROOT,
                          env=worker_env(), capture_output=True, text=True, timeout=limit(60))
    assert proc.returncode == 3
    assert proc.stderr.strip() == f"error: {tmp_path}: no valid checkpoint under checkpoints/; " \
                                  "train first"


@pytest.mark.parametrize("out", ["RUN", "RUN/checkpoints", "PARENT", "OTHER"])
def test_export_never_replaces_what_is_not_an_export(tmp_path, out):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    other = tmp_path / "notes"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    target = {"RUN": run_dir, "RUN/checkpoints": run_dir / "checkpoints", "PARENT": tmp_path,
              "OTHER": other}[out]
    with pytest.raises(ConfigError, match="--out"):
        check_output(run_dir, target)
    assert (other / "notes.txt").read_text() == "keep me"


def test_export_may_replace_an_earlier_export(tmp_path):
    run_dir, elsewhere = tmp_path / "run", tmp_path / "shipped"
    run_dir.mkdir()
    for target in (run_dir / "export", elsewhere):
        target.mkdir()
        (target / "model.json").write_text("{}")
        check_output(run_dir, target)  # no error


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("exported")
    config = write_config(root / "x.yaml", merge(TINY_GPT, {"output": {"dir": str(root)},
                                                            "train": {"max_steps": 2}}))
    assert run_train(config).returncode == 0
    return root / "x"


def export_to(run_dir, out, *extra: str):
    return subprocess.run([sys.executable, "entrypoint.py", "export", str(run_dir), "--out",
                           str(out), *extra], cwd=ROOT, env=worker_env(), capture_output=True,
                          text=True, timeout=limit(120))


def test_export_never_deletes_a_users_file_beside_a_model_json(trained, tmp_path):
    """A folder holding a model.json and anything else is not the export's to replace:
    exit 2, one line, every file as it was."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "model.json").write_text('{"mine": true}')
    (out / "notes.txt").write_text("keep me")
    proc = export_to(trained, out)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: command line: --out: {out} holds files an export did not write (notes.txt); "
        "export replaces only its own files: choose another --out"]
    assert (out / "notes.txt").read_text() == "keep me"
    assert (out / "model.json").read_text() == '{"mine": true}'


def test_an_earlier_export_is_replaced_file_by_file(trained, tmp_path):
    out = tmp_path / "shipped"
    assert export_to(trained, out).returncode == 0
    first = json.loads((out / "model.json").read_text())
    assert first["files"] == ["model.pt", "model.json"]
    inode = out.stat().st_ino
    (out / ".model.pt.tmp").write_bytes(b"left by an interrupted export")
    again = export_to(trained, out)
    assert again.returncode == 0, again.stderr
    assert out.stat().st_ino == inode, "the folder itself was never removed"
    assert sorted(p.name for p in out.iterdir()) == ["model.json", "model.pt"]
    assert json.loads((out / "model.json").read_text())["model_pt_sha256"] == \
        first["model_pt_sha256"]


def test_safetensors_export_holds_the_checkpoints_weights_and_replaces_model_pt(trained,
                                                                                 tmp_path):
    """--safetensors over an earlier model.pt export of the same folder: model.pt goes,
    model.safetensors holds every tensor of the checkpoint (the tied head too), and the
    model it loads into computes what the model.pt export's does."""
    out = tmp_path / "shipped"
    assert export_to(trained, out).returncode == 0
    before = load_model(out)
    proc = export_to(trained, out, "--safetensors")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["model.json", "model.safetensors"]
    meta = json.loads((out / "model.json").read_text())
    assert meta["files"] == ["model.safetensors", "model.json"] and "model_pt_sha256" not in meta
    ckpt = torch.load(trained / "checkpoints" / "step-2" / "state.pt", weights_only=True)
    written = safetensors_io.read(out / "model.safetensors")
    assert written.keys() == ckpt["model"].keys()
    assert all(torch.equal(written[k], v) for k, v in ckpt["model"].items())
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(load_model(out)(ids), before(ids))


def test_a_damaged_safetensors_file_is_one_line(trained, tmp_path):
    out = tmp_path / "st"
    assert export_to(trained, out, "--safetensors").returncode == 0
    data = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(ConfigError, match=r"model.safetensors: damaged or not a safetensors "
                                          r"file \(FormatError: .*\); export again"):
        load_model(out)


@pytest.mark.skipif(not installed("safetensors"), reason="safetensors is not installed "
                                                         "(make hf)")
def test_safetensors_files_agree_with_the_reference_implementation(tmp_path):
    """Ours written, theirs read, and the other way round: every dtype a model holds,
    a tied pair, an empty tensor."""
    from safetensors.torch import load_file, save_file
    tensors = {"f32": torch.randn(3, 4), "bf16": torch.randn(5).bfloat16(),
               "f16": torch.randn(2).half(), "i64": torch.arange(6).reshape(2, 3),
               "empty": torch.zeros(0, 3), "mask": torch.tensor([True, False])}
    tensors["tied"] = tensors["f32"]
    with open(tmp_path / "ours.safetensors", "wb") as f:
        safetensors_io.write(tensors, f)
    save_file({k: v.clone() for k, v in tensors.items()}, tmp_path / "theirs.safetensors")
    for read in (load_file(tmp_path / "ours.safetensors"),
                 safetensors_io.read(tmp_path / "theirs.safetensors")):
        assert read.keys() == tensors.keys()
        assert all(read[k].dtype == v.dtype and torch.equal(read[k], v)
                   for k, v in tensors.items())


@pytest.fixture
def token_file(tmp_path):
    """corpus.bin as `entrypoint.py tokenize --eos` writes it (in process), and the
    tokenizer's folder: its tokenizer.json alone."""
    if not installed("tokenizers"):
        pytest.skip("needs tokenizers: make hf")
    from tests.harness.corpus import EOS, train_tokenizer, write_corpus
    from train.tokenize_corpus import main
    corpus = write_corpus(tmp_path / "corpus", long_line=2_000)
    bpe = train_tokenizer(corpus, tmp_path / "bpe", vocab_size=320)
    out = tmp_path / "corpus.bin"
    assert main([str(corpus), "--tokenizer", str(bpe), "--out", str(out), "--eos", EOS]) == 0
    return out, bpe


def test_the_tokenizer_that_made_the_token_files_is_found_and_written(token_file, tmp_path):
    from train.export.tokenizer import locate
    out, bpe = token_file
    found, why_not = locate({"data": {"kind": "tokens", "path": str(out)}}, tmp_path)
    assert why_not is None and found.file == (bpe / "tokenizer.json").resolve()
    assert found.special_ids() == {"bos_token_id": None, "eos_token_id": 0,
                                   "pad_token_id": None}
    folder = tmp_path / "export"
    folder.mkdir()
    assert found.write(folder) == ["tokenizer.json", "tokenizer_config.json"]
    assert (folder / "tokenizer.json").read_bytes() == (bpe / "tokenizer.json").read_bytes()
    assert json.loads((folder / "tokenizer_config.json").read_text()) == {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    if installed("transformers"):
        from transformers import AutoTokenizer
        theirs = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        assert theirs.eos_token_id == 0
        assert theirs.decode(theirs("def f(x):\n")["input_ids"]) == "def f(x):\n"


def test_no_tokenizer_is_exported_but_the_one_the_run_trained_with(token_file, tmp_path):
    """Byte-level text needs none; token files without FILE.json, a manifest naming
    another tokenizer and a tokenizer.json changed since are each one line."""
    from train.export.tokenizer import locate
    out, bpe = token_file
    tokens = {"data": {"kind": "tokens", "path": str(out)}}
    assert locate({"data": {"kind": "text"}}, tmp_path) == (None, None)
    found, why_not = locate({"data": {"kind": "tokens", "path": str(tmp_path / "no.bin")}},
                            tmp_path)
    assert found is None and why_not.startswith("data.path: ")
    (tmp_path / "manifest.json").write_text(json.dumps(
        {"data": f"tokens corpus.bin (9 tokens, tokenizer.json sha256 {'0' * 64})"}))
    found, why_not = locate(tokens, tmp_path)
    assert found is None and why_not.startswith("the token file was made again")
    (tmp_path / "manifest.json").unlink()
    with open(bpe / "tokenizer.json", "a") as f:
        f.write("\n")
    found, why_not = locate(tokens, tmp_path)
    assert found is None and "tokenizer.json changed since the token files were made" in why_not
    (tmp_path / "corpus.bin.json").unlink()
    found, why_not = locate(tokens, tmp_path)
    assert found is None and why_not.startswith("data.path's token files name no tokenizer")
