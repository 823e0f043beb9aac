"""Text corpora and Hugging Face tokenizers made in the test (nothing can be downloaded):
a small byte-level BPE trained with the ``tokenizers`` package on local text, and the
``entrypoint.py tokenize`` command run as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.harness.runs import ENTRY, clean_env, limit

EOS = "<|endoftext|>"
# Real text present on every machine: the standard library's json package, plus a file
# of non-ASCII text (multi-byte UTF-8) with a line longer than a piece of a long file.
STDLIB_JSON = Path(subprocess.__file__).parent / "json"
NON_ASCII = "Grüße, ünïcödé — 日本語のテキスト, emoji 🙂; "


def write_corpus(folder: Path, *, long_line: int = 300_000) -> Path:
    """A folder of .py files: the json package's sources and one non-ASCII file."""
    folder.mkdir(parents=True, exist_ok=True)
    for source in sorted(STDLIB_JSON.glob("*.py")):
        (folder / source.name).write_text(source.read_text(encoding="utf-8"), encoding="utf-8")
    lines = [NON_ASCII * 3 for _ in range(50)] + [NON_ASCII * (long_line // len(NON_ASCII))]
    (folder / "zz_unicode.py").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (folder / "notes.txt").write_text("not matched by the default glob\n")
    return folder


def train_tokenizer(corpus: Path, out: Path, vocab_size: int = 400) -> Path:
    """A byte-level BPE tokenizer (GPT-2's scheme) trained on the corpus' .py files,
    saved as ``out/tokenizer.json``; the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train(sorted(str(p) for p in corpus.glob("*.py")), trainer)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    return out


def tokenize(*args: str, cwd: Path, env: dict | None = None,
             timeout: float = 120) -> subprocess.CompletedProcess:
    """``entrypoint.py tokenize ARGS``."""
    return subprocess.run([sys.executable, ENTRY, "tokenize", *map(str, args)], cwd=cwd,
                          env=env or clean_env(), capture_output=True, text=True,
                          timeout=limit(timeout))
