"""Training on the token file ``entrypoint.py tokenize`` writes with a real tokenizer: the
same losses at world size 1 and 2 (gloo, 127.0.0.1), since the sample order does not
depend on the world size; the manifest names the tokenizer that made the data."""

from __future__ import annotations

import hashlib
import json

import pytest

from tests.harness.corpus import EOS, tokenize, train_tokenizer, write_corpus
from tests.harness.runs import TINY_GPT, installed, losses, merge, run_train, write_config

STEPS = 6


@pytest.mark.skipif(not installed("tokenizers"), reason="needs tokenizers: make hf")
def test_training_on_tokenized_text_has_the_same_losses_on_one_and_two_processes(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", long_line=2_000)
    bpe = train_tokenizer(corpus, tmp_path / "bpe", vocab_size=320)
    out = tmp_path / "corpus.bin"
    made = tokenize(corpus, "--tokenizer", bpe, "--out", out, "--eos", EOS, cwd=tmp_path)
    assert made.returncode == 0, made.stderr
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
