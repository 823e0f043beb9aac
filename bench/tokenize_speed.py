"""``entrypoint.py tokenize`` against the plain way to do it, in the same run: read every
file, ``encode_batch_fast`` them all at once, write the ids with ``numpy.tofile``. Each
is a separate process (its wall time and peak RSS from ``os.wait4``), on the text kind's
default corpus (the standard library's sources) repeated 1 and 3 times, so a memory that
grows with the corpus shows; rounds alternate which runs first. The tokenizer is a
byte-level BPE trained here on part of the corpus (nothing is downloaded). Prints, per
corpus size, the medians and the ratios tokenize / plain.

    python -m bench.tokenize_speed [--rounds 2] [--vocab 4096] [--copies 1 3]

Needs the tokenizers package (``make hf``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PLAIN = """
import sys, numpy as np
from pathlib import Path
from tokenizers import Tokenizer
from train.core.datasets.datafiles import text_files
root, tok, out = Path(sys.argv[1]), Tokenizer.from_file(sys.argv[2]), sys.argv[3]
texts = [p.read_text(encoding="utf-8") for p in text_files(root, "**/*.py")]
ids = [i for e in tok.encode_batch_fast(texts, add_special_tokens=False) for i in e.ids]
np.asarray(ids, dtype=np.uint16).tofile(out)
"""


def measured(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS in MiB) of one process."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - start
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"failed: {' '.join(cmd)}: {proc.stderr.read().decode()[-2000:]}")
    return wall, usage.ru_maxrss / 1024


def corpus(work: Path, copies: int) -> Path:
    """The standard library's .py files (site-packages left out), ``copies`` times."""
    from train.core.datasets.datafiles import text_files
    from train.data.builders import default_text_root
    stdlib = Path(default_text_root())
    folder = work / f"corpus-{copies}"
    for copy in range(copies):
        for path in text_files(stdlib, "**/*.py"):
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            target = folder / str(copy) / path.relative_to(stdlib)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
    return folder


def train_tokenizer(folder: Path, out: Path, vocab: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train(sorted(str(p) for p in folder.glob("0/*.py")), trainer)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    return out


def one_size(work: Path, folder: Path, tok: Path, rounds: int) -> dict[str, list]:
    ours = [sys.executable, str(ROOT / "entrypoint.py"), "tokenize", str(folder),
            "--tokenizer", str(tok), "--out", str(work / "ours.bin"), "--force"]
    plain = [sys.executable, "-c", PLAIN, str(folder), str(tok / "tokenizer.json"),
             str(work / "plain.bin")]
    results = {"tokenize": [], "plain": []}
    for r in range(rounds):
        order = [("tokenize", ours), ("plain", plain)]
        for name, cmd in order if r % 2 == 0 else order[::-1]:
            results[name].append(measured(cmd))
    same = (work / "ours.bin").stat().st_size == (work / "plain.bin").stat().st_size
    print(f"  token files of the same size: {same}")
    return results


def report(copies: int, size: int, results: dict[str, list]) -> None:
    med = {k: (statistics.median(w for w, _ in v), statistics.median(m for _, m in v))
           for k, v in results.items()}
    print(f"corpus x{copies} ({size / 1e6:.1f} MB):")
    for name, (wall, rss) in med.items():
        print(f"  {name:9} {wall:7.2f} s  {size / 1e6 / wall:6.2f} MB/s  peak RSS {rss:7.1f} MiB")
    print(f"  ratio tokenize/plain: wall {med['tokenize'][0] / med['plain'][0]:.2f}, "
          f"peak RSS {med['tokenize'][1] / med['plain'][1]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--copies", type=int, nargs="+", default=[1, 3])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-tokenize-") as tmp:
        work = Path(tmp)
        tok = None
        for copies in args.copies:
            folder = corpus(work, copies)
            tok = tok or train_tokenizer(folder, work / "bpe", args.vocab)
            size = sum(p.stat().st_size for p in folder.rglob("*.py"))
            report(copies, size, one_size(work, folder, tok, args.rounds))


if __name__ == "__main__":
    main()
