"""``entrypoint.py tokenize``: a text corpus as the token file ``data.kind: tokens`` reads,
with a real Hugging Face tokenizer trained here on local text. The ids decode back to the
corpus, the tokens kind reads the file, bad input is one line and exit 2 with nothing
written, and a run killed mid-write leaves no file under the final name."""

from __future__ import annotations

import hashlib
import json
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.harness.corpus import EOS, NON_ASCII, tokenize, train_tokenizer, write_corpus
from tests.harness.runs import ENTRY, TINY_GPT, clean_env, installed, limit, merge, write_config
from train.core.datasets.datafiles import text_files
from train.tokenize_corpus import pieces

needs_tokenizers = pytest.mark.skipif(not installed("tokenizers"),
                                      reason="needs tokenizers: make hf")


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    """A corpus and a BPE tokenizer trained on it (once for the module)."""
    if not installed("tokenizers"):
        pytest.skip("needs tokenizers: make hf")
    root = tmp_path_factory.mktemp("tok")
    corpus = write_corpus(root / "corpus")
    return {"root": root, "corpus": corpus, "tokenizer": train_tokenizer(corpus, root / "bpe")}


def decoder(folder: Path):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


@needs_tokenizers
def test_each_files_ids_decode_to_its_text_and_the_tokens_kind_reads_them(made, tmp_path):
    out = tmp_path / "corpus.bin"
    done = tokenize(made["corpus"], "--tokenizer", made["tokenizer"], "--out", out,
                    "--eos", EOS, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    files = text_files(made["corpus"], "**/*.py")  # data.kind text's selection and order
    summary = done.stdout.strip().splitlines()
    assert len(summary) == 1 and summary[0].startswith(f"tokenize: {len(files)} files, ")
    assert "data.vocab_size=400" in summary[0]

    ids = np.fromfile(out, dtype=np.uint16)
    tokenizer = decoder(made["tokenizer"])
    eos = tokenizer.token_to_id(EOS)
    assert ids[-1] == eos
    per_file = np.split(ids, np.flatnonzero(ids == eos) + 1)[:-1]
    assert len(per_file) == len(files) and all(part[-1] == eos for part in per_file)
    for path, part in zip(files, per_file, strict=True):
        assert tokenizer.decode(part[:-1].tolist()) == path.read_text(encoding="utf-8"), path

    meta = json.loads(out.with_name("corpus.bin.json").read_text())
    tokenizer_hash = hashlib.sha256((made["tokenizer"] / "tokenizer.json").read_bytes())
    assert meta["tokenizer"]["sha256"] == tokenizer_hash.hexdigest() in summary[0]
    assert meta["tokens"] == len(ids) and meta["vocab_size"] == 400
    assert meta["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()
    assert meta["corpus"]["files"] == len(files)
    assert meta["corpus"]["bytes"] == sum(p.stat().st_size for p in files)
    assert not out.with_name("corpus.bin.partial").exists()
    check_read_by_the_tokens_kind(out, ids, tmp_path, meta["tokenizer"]["sha256"])


def check_read_by_the_tokens_kind(out: Path, ids: np.ndarray, tmp_path: Path,
                                  tokenizer_hash: str) -> None:
    """The tokens kind's dataset (built in process) holds exactly these ids as windows,
    and its description (the run's manifest) names the tokenizer."""
    import torch

    from train.core.config import load_config
    from train.data.builders import build_data
    cfg = load_config(write_config(tmp_path / "c.yaml", merge(TINY_GPT, {
        "data": {"kind": "tokens", "path": str(out), "vocab_size": 400}})))
    data = build_data(cfg)
    x, y = data.train.__getitems__([0, 5])
    want = torch.from_numpy(ids[5 * 16:5 * 16 + 17].astype(np.int64))
    assert torch.equal(x[1], want[:-1]) and torch.equal(y[1], want[1:])
    assert len(data.train) + len(data.val) == (len(ids) - 1) // 16
    assert data.num_classes == 400 and tokenizer_hash in data.description


def test_pieces_of_a_long_file_end_at_line_ends_and_join_to_its_text(tmp_path):
    text = "short\n" + NON_ASCII * 40 + "\n\n" + "x" * 90 + "\nend without a newline " + NON_ASCII
    path = tmp_path / "f.txt"
    path.write_text(text, encoding="utf-8")
    stats = {"bytes": 0}
    got = list(pieces(path, stats, size=32))  # reads cut multi-byte characters too
    assert "".join(got) == text and stats["bytes"] == len(text.encode())
    assert len(got) > 5
    for piece in got[:-1]:
        assert piece.endswith("\n") or len(piece.encode()) >= 32, repr(piece)


def bad_inputs(made: dict[str, Path], tmp: Path) -> dict[str, tuple[list, str]]:
    """name -> (arguments, what the one line says)."""
    tok, corpus = made["tokenizer"], made["corpus"]
    (tmp / "empty").mkdir()
    (tmp / "blank").mkdir()
    (tmp / "blank" / "a.py").write_text("")
    (tmp / "latin1").mkdir()
    (tmp / "latin1" / "a.py").write_bytes("caf\xe9\n".encode("latin-1"))
    (tmp / "not-a-tokenizer").mkdir()
    (tmp / "garbage").mkdir()
    (tmp / "garbage" / "tokenizer.json").write_text('{"model": 3}')
    (tmp / "exists.bin").write_bytes(b"old!")
    out = tmp / "out.bin"
    return {
        "no tokenizer": ([corpus, "--tokenizer", tmp / "nowhere", "--out", out],
                         "--tokenizer: " + str(tmp / "nowhere") + ": no such file"),
        "no tokenizer.json": ([corpus, "--tokenizer", tmp / "not-a-tokenizer", "--out", out],
                              "not a tokenizer: no tokenizer.json"),
        "not a tokenizer": ([corpus, "--tokenizer", tmp / "garbage", "--out", out],
                            "not a tokenizer file the tokenizers package reads"),
        "no files": ([tmp / "empty", "--tokenizer", tok, "--out", out], "no file matches"),
        "no text": ([tmp / "blank", "--tokenizer", tok, "--out", out],
                    "no text in the files matching --glob: 0 tokens"),
        "not UTF-8": ([tmp / "latin1", "--tokenizer", tok, "--out", out],
                      "a.py: CORPUS_DIR: not UTF-8 text at byte 3"),
        "exists": ([corpus, "--tokenizer", tok, "--out", tmp / "exists.bin"],
                   "exists; add --force"),
        "unknown eos": ([corpus, "--tokenizer", tok, "--out", out, "--eos", "<eos>"],
                        "--eos: '<eos>' is not a token"),
        "no --out": ([corpus, "--tokenizer", tok], "--out"),
        "no folder for --out": ([corpus, "--tokenizer", tok, "--out", tmp / "no" / "x.bin"],
                                "no such directory"),
    }


@needs_tokenizers
def test_bad_input_is_one_line_exit_2_and_writes_nothing(made, tmp_path):
    for name, (args, says) in bad_inputs(made, tmp_path).items():
        before = sorted(p.name for p in tmp_path.rglob("*"))
        proc = tokenize(*args, cwd=tmp_path)
        assert proc.returncode == 2, (name, proc.stderr)
        assert says in one_error_line(proc), (name, proc.stderr)
        assert sorted(p.name for p in tmp_path.rglob("*")) == before, name
    assert (tmp_path / "exists.bin").read_bytes() == b"old!"


@needs_tokenizers
def test_a_vocabulary_too_large_for_uint16_is_refused(made, tmp_path):
    from tokenizers import Tokenizer, models
    words = {f"w{i}": i for i in range(70_000)}
    big = tmp_path / "big"
    big.mkdir()
    Tokenizer(models.WordLevel(words, unk_token="w0")).save(str(big / "tokenizer.json"))
    proc = tokenize(made["corpus"], "--tokenizer", big, "--out", tmp_path / "o.bin",
                    cwd=tmp_path)
    assert proc.returncode == 2
    assert "a vocabulary of 70,000 ids; the tokens kind reads uint16 ids, at most 65,536" \
        in one_error_line(proc)
    assert not list(tmp_path.glob("o.bin*"))


def test_without_the_tokenizers_package_it_is_exit_3_naming_make_hf(tmp_path):
    shadow = tmp_path / "shadow" / "tokenizers"  # this interpreter without the package
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named "
                                        "'tokenizers'\", name='tokenizers')\n")
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    corpus = write_corpus(tmp_path / "corpus", long_line=10)
    proc = tokenize(corpus, "--tokenizer", tok, "--out", tmp_path / "o.bin", cwd=tmp_path,
                    env=clean_env(PYTHONPATH=str(tmp_path / "shadow")))
    assert proc.returncode == 3, proc.stderr
    line = one_error_line(proc)
    assert "tokenizers package is not installed" in line and "make hf" in line
    assert not list(tmp_path.glob("o.bin*"))


@needs_tokenizers
def test_killed_mid_write_leaves_the_previous_file_and_a_rerun_completes(made, tmp_path):
    """SIGKILL once ids are on disk: the final name still holds the previous file (here
    one written before, replaced with --force), never a torn one, and no description of
    the new one; the rerun replaces the leftover partial file and completes."""
    big = tmp_path / "big"
    big.mkdir()
    text = "".join(p.read_text(encoding="utf-8") for p in sorted(made["corpus"].glob("*.py")))
    for i in range(max(2, (12 << 20) // len(text.encode()))):  # about 12 MB: 6 batches
        (big / f"part{i:03}.py").write_text(text, encoding="utf-8")
    out, partial = tmp_path / "big.bin", tmp_path / "big.bin.partial"
    out.write_bytes(b"previous")
    proc = subprocess.Popen([sys.executable, ENTRY, "tokenize", str(big), "--tokenizer",
                             str(made["tokenizer"]), "--out", str(out), "--force"],
                            cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + limit(120)
    while not (partial.exists() and partial.stat().st_size > 0):
        assert proc.poll() is None, f"finished before it could be killed: {proc.stderr.read()}"
        assert time.monotonic() < deadline, "no ids written"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=limit(60))
    assert out.read_bytes() == b"previous" and partial.exists()
    assert not out.with_name("big.bin.json").exists()
    for part in sorted(big.iterdir())[1:]:  # the rerun needs no long corpus
        part.unlink()
    again = tokenize(big, "--tokenizer", made["tokenizer"], "--out", out, "--force",
                     cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr
    assert not partial.exists()
    meta = json.loads(out.with_name("big.bin.json").read_text())
    assert meta["tokens"] * 2 == out.stat().st_size
    assert meta["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()


@needs_tokenizers
def test_a_write_the_disk_refuses_is_exit_3_and_leaves_the_previous_file(made, tmp_path):
    """A file size limit (RLIMIT_FSIZE) makes the kernel refuse the writes past 64 KiB,
    as a full disk would: one line, exit 3, the previous file as it was, no partial file."""
    out = tmp_path / "o.bin"
    out.write_bytes(b"previous")
    limited = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))  # noqa: E731
    proc = subprocess.run([sys.executable, ENTRY, "tokenize", str(made["corpus"]),
                           "--tokenizer", str(made["tokenizer"]), "--out", str(out), "--force"],
                          cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                          timeout=limit(120), preexec_fn=limited)
    assert proc.returncode == 3, proc.stderr
    assert f"{out}: cannot write (File too large)" in one_error_line(proc)
    assert out.read_bytes() == b"previous" and sorted(tmp_path.iterdir()) == [out]
