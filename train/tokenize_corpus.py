"""A text corpus as a token file: ``entrypoint.py tokenize CORPUS_DIR --tokenizer DIR --out FILE``.

``data.kind: text`` trains a byte-level model; a model with a real vocabulary trains on
``data.kind: tokens``, whose file this writes with a Hugging Face tokenizer from a local
folder (its ``tokenizer.json``; the ``tokenizers`` package, which ``make hf`` or the
``hf`` extra brings). The files are the text kind's: those under CORPUS_DIR matching
``--glob`` (the default of ``data.text_glob``), in sorted order, each file's tokens after
the previous file's (``--eos TOKEN`` puts that token after each file).

The corpus is streamed: about :data:`BATCH` bytes of text at a time go to the tokenizer's
batch API (its threads encode the pieces in parallel), and their ids are appended to the
file, so memory stays bounded whatever the corpus size. A file longer than :data:`PIECE`
is encoded in pieces cut at line ends, so a token may differ from the whole file's at a
cut; decoding the ids gives the text back all the same. The file is written atomically
(:mod:`train.data.tokenfile`), with ``FILE.json`` beside it naming the tokenizer
(``tokenizer.json``'s SHA-256). One summary line at the end.
"""

from __future__ import annotations

import argparse
import codecs
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from train.core.config.schema import DataConfig
from train.core.datasets.datafiles import text_files
from train.core.errors import EXIT_STOPPED_BY_SIGNAL, CannotRunHere, ConfigError, UserError
from train.core.files import sha256_file

PIECE = 256 << 10   # text per piece of a long file, cut at a line end
BATCH = 1 << 20     # text per call of the tokenizer's batch API
TOKENIZER_FILE = "tokenizer.json"


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, exit 2 (not usage and a traceback)."""

    def error(self, message: str):
        raise ConfigError("command line", "tokenize", message)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = _Parser(prog="tokenize", description=__doc__.splitlines()[0])
    parser.add_argument("corpus", type=Path, metavar="CORPUS_DIR",
                        help="a folder of text files (read as data.kind: text reads them)")
    parser.add_argument("--tokenizer", type=Path, required=True, metavar="DIR",
                        help="a folder holding tokenizer.json (or that file itself)")
    parser.add_argument("--out", type=Path, required=True, metavar="FILE",
                        help="the token file to write (FILE.json is written beside it)")
    parser.add_argument("--glob", default=DataConfig().text_glob,
                        help="which files under CORPUS_DIR (default: data.text_glob's, "
                             "%(default)s)")
    parser.add_argument("--eos", metavar="TOKEN", help="a token of the vocabulary to put after "
                                                       "each file, e.g. '<|endoftext|>'")
    parser.add_argument("--force", action="store_true", help="replace FILE if it exists")
    return parser.parse_args(argv)


def corpus_files(root: Path, glob: str) -> list[Path]:
    if not root.is_dir():
        raise ConfigError("command line", "CORPUS_DIR", f"{root}: not a directory")
    files = text_files(root, glob)
    if not files:
        raise ConfigError(str(root), "--glob", f"no file matches {glob!r} under {root}; point "
                                               "CORPUS_DIR at a folder of text files or "
                                               "change --glob")
    return files


def check_out(out: Path, force: bool) -> None:
    if not out.parent.is_dir():
        raise ConfigError("command line", "--out", f"{out.parent}: no such directory")
    if out.is_dir():
        raise ConfigError("command line", "--out", f"{out}: a directory; name the file")
    if out.exists() and not force:
        raise ConfigError("command line", "--out", f"{out} exists; add --force to replace it")


def tokenizer_json(path: Path) -> Path:
    if not path.exists():
        raise ConfigError("command line", "--tokenizer", f"{path}: no such file or directory")
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(str(path), "--tokenizer", f"not a tokenizer: no {TOKENIZER_FILE} "
                                                    "in it (a Hugging Face fast tokenizer's "
                                                    "save_pretrained writes one)")
    return file


def load_tokenizer(file: Path):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise CannotRunHere(f"the tokenizers package is not installed for {sys.executable}; "
                            "in a checkout `make hf` installs it (locked), elsewhere pip "
                            "install 'trainpod[hf]' (transformers brings it)") from None
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # the Rust side raises its own Exception for any bad file
        reason = " ".join(str(exc).split())[:200]
        raise ConfigError(str(file), "--tokenizer", f"not a tokenizer file the tokenizers "
                                                    f"package reads: {reason}") from None


def pieces(path: Path, stats: dict, size: int = PIECE) -> Iterator[str]:
    """The file's text in pieces of about ``size`` bytes, each ending at a line end when
    it has one; text that is not UTF-8 is one line naming the file and the byte."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    carry, offset = "", 0
    try:
        f = path.open("rb")
    except OSError as exc:
        raise ConfigError(str(path), "CORPUS_DIR", f"cannot read: {exc.strerror}") from None
    with f:
        while True:
            block = f.read(size)
            pending = len(decoder.getstate()[0])  # bytes of a character cut by the read
            try:
                text = carry + decoder.decode(block, final=not block)
            except UnicodeDecodeError as exc:
                raise ConfigError(str(path), "CORPUS_DIR", f"not UTF-8 text at byte "
                                  f"{offset - pending + exc.start}; convert it, or leave it "
                                  "out with --glob") from None
            offset += len(block)
            stats["bytes"] += len(block)
            if not block:
                if text:
                    yield text
                return
            cut = text.rfind("\n") + 1
            if cut == 0 and len(text) < size:
                carry = text  # a long line: wait for its end, up to a piece
                continue
            cut = cut or len(text)
            yield text[:cut]
            carry = text[cut:]


def _last_marked(items: Iterator[str]) -> Iterator[tuple[str, bool]]:
    """(item, whether it is the last one)."""
    previous = None
    for item in items:
        if previous is not None:
            yield previous, False
        previous = item
    if previous is not None:
        yield previous, True


def batches(files: list[Path], stats: dict) -> Iterator[list[tuple[str, bool]]]:
    """(piece, whether it ends its file) in batches of about BATCH bytes."""
    batch, size = [], 0
    for path in files:
        for piece, ends_file in _last_marked(pieces(path, stats)):
            batch.append((piece, ends_file))
            size += len(piece)
            if size >= BATCH:
                yield batch
                batch, size = [], 0
        stats["files"] += 1
    if batch:
        yield batch


def encode(tokenizer, batch: list[tuple[str, bool]], eos: int | None):
    """The ids of a batch of pieces, in order, ``eos`` after each file's last piece."""
    import numpy as np
    encodings = tokenizer.encode_batch_fast([text for text, _ in batch],
                                            add_special_tokens=False)
    parts = []
    for encoding, (_, ends_file) in zip(encodings, batch, strict=True):
        parts.append(np.asarray(encoding.ids, dtype=np.uint32))
        if ends_file and eos is not None:
            parts.append(np.asarray([eos], dtype=np.uint32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)


def eos_id(tokenizer, token: str | None) -> int | None:
    if token is None:
        return None
    found = tokenizer.token_to_id(token)
    if found is None:
        raise ConfigError("command line", "--eos", f"{token!r} is not a token of this "
                                                   "tokenizer's vocabulary")
    return found


def tokenize(args: argparse.Namespace) -> str:
    """Write the token file; the summary line."""
    from train.data.tokenfile import dtype_for
    files = corpus_files(args.corpus, args.glob)
    check_out(args.out, args.force)
    source = tokenizer_json(args.tokenizer)
    tokenizer = load_tokenizer(source)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = dtype_for(vocab)
    if dtype is None:
        raise ConfigError(str(source), "--tokenizer", f"a vocabulary of {vocab:,} ids; the "
                                                      "tokens kind reads uint16 ids, at most "
                                                      "65,536")
    eos = eos_id(tokenizer, args.eos)
    digest = sha256_file(source)
    start, stats = time.monotonic(), {"files": 0, "bytes": 0}
    count = write(args, dtype, (encode(tokenizer, batch, eos) for batch in batches(files, stats)),
                  lambda: {"vocab_size": vocab, "eos": args.eos,
                           "tokenizer": {"path": str(source.resolve()), "sha256": digest},
                           "corpus": {"path": str(args.corpus.resolve()), "glob": args.glob,
                                      "files": stats["files"], "bytes": stats["bytes"]}})
    return (f"tokenize: {stats['files']} files, {stats['bytes']:,} bytes -> "
            f"{count:,} tokens ({dtype}) in {args.out}, {time.monotonic() - start:.1f} s; "
            f"vocab {vocab:,} (train with data.kind=tokens data.path={args.out} "
            f"data.vocab_size={vocab}); {TOKENIZER_FILE} sha256 {digest}")


def write(args: argparse.Namespace, dtype: str, chunks: Iterator, description) -> int:
    """The ids of ``chunks`` as the token file, described by ``description()`` once all
    are written; the token count. Whatever goes wrong, no partial file is left behind."""
    from train.data.tokenfile import TokenFileWriter
    writer = None
    try:
        writer = TokenFileWriter(args.out, dtype)
        for ids in chunks:
            writer.append(ids)
        if writer.count == 0:
            raise ConfigError(str(args.corpus), "CORPUS_DIR", "no text in the files matching "
                                                              "--glob: 0 tokens")
        writer.commit(description())
        return writer.count
    except OSError as exc:  # reading errors are ConfigErrors already: the output's
        raise CannotRunHere(f"{args.out}: cannot write ({exc.strerror or exc}); free some "
                            "space or choose another --out") from None
    finally:
        if writer is not None and writer.partial.exists():
            writer.discard()


def main(argv: list[str] | None = None) -> int:
    try:
        line = tokenize(parse(sys.argv[1:] if argv is None else argv))
    except UserError as exc:
        print(exc.one_line(), file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # the partial file is already gone; nothing to resume
        return EXIT_STOPPED_BY_SIGNAL
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
