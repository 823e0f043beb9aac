"""Training on the token file ``entrypoint.py tokenize`` writes with a real tokenizer: the
same losses at world size 1 and 2 (gloo, 127.0.0.1), since the sample order does not
depend on the world size; the manifest names the tokenizer that made the data. A
``model.kind: hf`` model trained on it exports with that tokenizer, for AutoTokenizer."""

from __future__ import annotations

import hashlib
import json

import pytest

from tests.harness.corpus import EOS, tokenize, train_tokenizer, write_corpus
from tests.harness.runs import (
    TINY_GPT,
    entry,
    installed,
    losses,
    merge,
    run_train,
    write_config,
)

STEPS = 6


def tokenized(tmp_path):
    """A BPE tokenizer trained on a small corpus, and the corpus tokenized with it
    (``--eos``): (the tokenizer's folder, the token file)."""
    corpus = write_corpus(tmp_path / "corpus", long_line=2_000)
    bpe = train_tokenizer(corpus, tmp_path / "bpe", vocab_size=320)
    out = tmp_path / "corpus.bin"
    made = tokenize(corpus, "--tokenizer", bpe, "--out", out, "--eos", EOS, cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    return bpe, out


@pytest.mark.skipif(not installed("tokenizers"), reason="needs tokenizers: make hf")
def test_training_on_tokenized_text_has_the_same_losses_on_one_and_two_processes(tmp_path):
    bpe, out = tokenized(tmp_path)
    config = write_config(tmp_path / "tok.yaml", merge(TINY_GPT, {
        "data": {"kind": "tokens", "path": str(out), "vocab_size": 320},
        "train": {"max_steps": STEPS}, "checkpoint": {"every_steps": STEPS}}))
    runs = {}
    for nproc in (1, 2):
        proc = run_train(config, f"output.dir={tmp_path / str(nproc)}", nproc=nproc)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[nproc] = losses(tmp_path / str(nproc) / "tok")
    assert sorted(runs[1]) == list(range(1, STEPS + 1))
    assert runs[2] == pytest.approx(runs[1], rel=1e-5)
    manifest = json.loads((tmp_path / "2" / "tok" / "manifest.json").read_text())
    digest = hashlib.sha256((bpe / "tokenizer.json").read_bytes()).hexdigest()
    assert f"tokenizer.json sha256 {digest}" in manifest["data"]


# LlamaConfig derives head_dim (hidden_size // heads: 16) in its constructor
LLAMA = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
         "intermediate_size": 128}


@pytest.mark.skipif(not installed("tokenizers", "transformers"),
                    reason="needs transformers: make hf")
def test_an_hf_model_trained_on_tokenized_text_exports_with_its_tokenizer(tmp_path):
    """A tiny Llama (model.kind hf, its overrides) on the tokenize --eos file: the export
    is the model LlamaConfig(**overrides) builds, carries the tokenizer
    (AutoTokenizer reads it), its special ids are the tokenizer's (eos: the --eos token,
    id 0; not Llama's 1 and 2), and generation keeps the key/value cache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig
    bpe, out = tokenized(tmp_path)
    config = write_config(tmp_path / "llama.yaml", merge(TINY_GPT, {
        "model": {"kind": "hf", "args": {"config": "LlamaConfig", "overrides": LLAMA}},
        "data": {"kind": "tokens", "path": str(out), "vocab_size": 320},
        "train": {"max_steps": 2}, "output": {"dir": str(tmp_path / "runs")}}))
    trained = run_train(config)
    assert trained.returncode == 0, trained.stderr[-3000:]
    done = entry("export", str(tmp_path / "runs" / "llama"), cwd=tmp_path)
    assert done.returncode == 0 and "warning" not in done.stderr, done.stderr
    export = tmp_path / "runs" / "llama" / "export"
    meta = json.loads((export / "model.json").read_text())
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(meta["files"])
    digest = hashlib.sha256((bpe / "tokenizer.json").read_bytes()).hexdigest()
    assert meta["tokenizer"] == {"source": str((bpe / "tokenizer.json").resolve()),
                                 "sha256": digest, "eos": EOS}
    theirs = AutoModelForCausalLM.from_pretrained(export, local_files_only=True).eval()
    reference = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA, vocab_size=320))
    assert theirs.config.head_dim == 16
    assert sum(p.numel() for p in theirs.parameters()) == sum(
        p.numel() for p in reference.parameters())
    text = AutoTokenizer.from_pretrained(export, local_files_only=True)
    assert text.eos_token == EOS and text.eos_token_id == 0
    assert (theirs.config.bos_token_id, theirs.config.eos_token_id) == (None, 0)
    generation = json.loads((export / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 0 and generation.get("use_cache", True)
    prompt = text("def ", return_tensors="pt")["input_ids"]
    sampled = theirs.generate(prompt, max_new_tokens=4, do_sample=False)
    assert sampled.shape[1] <= prompt.shape[1] + 4
