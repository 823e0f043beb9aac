"""Text from a trained byte-level language model: ``entrypoint.py generate RUN_DIR --prompt TEXT``.

The quick start's model reads and writes bytes (``data.kind: text``, a vocabulary of
256), so its samples are text with no tokenizer; so does any causal LM trained on that
data (``model.kind: hf``, or your own model: its output may be a ModelOutput). This
loads the run's export (``RUN_DIR/export``, written by ``entrypoint.py export``; or an
export folder itself), continues the prompt one byte at a time from the last
``model.context_length`` bytes, and prints prompt and continuation. Sampling: softmax at
``--temperature`` over the ``--top-k`` likeliest bytes, from ``--seed`` (the same seed,
the same text); ``--temperature 0`` takes the likeliest byte each time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from train.core.errors import ConfigError, UserError
from train.core.run import rundir

BYTES = 256


def export_folder(path: Path) -> Path:
    """The export to sample from: ``path`` itself, or the run directory's export/."""
    for folder in (path, path / rundir.EXPORT):
        if (folder / rundir.EXPORT_META).is_file():
            return folder
    raise ConfigError("command line", "RUN_DIR", (
        f"{path}: no export here (no model.json in it or in its export/): run "
        f"`entrypoint.py export {path}` first"))


def check_byte_lm(folder: Path) -> dict:
    """model.json of a next-token model over bytes, or one line saying what generate
    supports."""
    try:
        meta = json.loads((folder / rundir.EXPORT_META).read_text(encoding="utf-8"))
        kind = meta.get("model", {}).get("kind")
    except (OSError, ValueError, AttributeError) as exc:
        raise ConfigError("command line", "RUN_DIR", f"{folder / rundir.EXPORT_META}: not an "
                          f"export's model.json ({type(exc).__name__}); export again") from None
    vocabulary = (meta.get("io") or {}).get("num_classes")
    causal = meta.get("causal_lm", kind == "gpt")  # exports before the field: gpt only
    if not causal or vocabulary != BYTES:
        what = (f"a {kind} model over {vocabulary} token ids, which needs a tokenizer"
                if causal else f"a {kind} model with {vocabulary} outputs, not trained to "
                               "predict the next token")
        raise ConfigError("command line", "RUN_DIR", (
            f"{folder}: {what}; generate writes text from a byte-level causal language model "
            f"({BYTES} outputs, trained on data.kind=text: model.kind gpt or hf, or your own)"))
    return meta


def sample(model, prompt: bytes, count: int, *, temperature: float, top_k: int,
           seed: int, context: int) -> bytes:
    import torch

    from train.models.losses import logits_of  # a tensor, or a ModelOutput holding the logits
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    with torch.no_grad():
        for _ in range(count):
            logits = logits_of(model(ids[:, -context:]))[0, -1].float()
            if temperature == 0:
                choice = logits.argmax().view(1)
            else:
                weights = logits / temperature
                if 0 < top_k < BYTES:
                    floor = torch.topk(weights, top_k).values[-1]
                    weights = weights.masked_fill(weights < floor, -torch.inf)
                choice = torch.multinomial(torch.softmax(weights, -1), 1, generator=generator)
            ids = torch.cat([ids, choice.view(1, 1)], dim=1)
    return bytes(ids[0, len(prompt):].tolist())


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="generate", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a run directory (its export/) or an export")
    parser.add_argument("--prompt", default="\n", help="the text to continue (default: a "
                                                       "newline)")
    parser.add_argument("--tokens", type=int, default=200, help="bytes to add (default 200)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="0: the likeliest byte each time (default 0.8)")
    parser.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest "
                                                              "(0: all; default 40)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    checks = [("--tokens", args.tokens, 1 <= args.tokens <= 100_000, "1..100000"),
              ("--temperature", args.temperature, 0 <= args.temperature <= 100, "0..100"),
              ("--top-k", args.top_k, 0 <= args.top_k <= BYTES, f"0..{BYTES}"),
              ("--seed", args.seed, 0 <= args.seed < 2**63, "0..2^63-1"),
              ("--prompt", "(empty)", bool(args.prompt), "at least one character")]
    for flag, value, ok, allowed in checks:
        if not ok:
            raise ConfigError("command line", flag, f"{value}: expected {allowed}")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
        folder = export_folder(args.run_dir)
        meta = check_byte_lm(folder)
        from train.export import load_model
        model = load_model(folder)
        prompt = args.prompt.encode("utf-8", "surrogateescape")  # the bytes as typed
        text = sample(model, prompt, args.tokens, temperature=args.temperature,
                      top_k=args.top_k, seed=args.seed,
                      context=meta["model"]["context_length"])
    except UserError as exc:
        print(exc.one_line(), file=sys.stderr)
        return exc.exit_code
    sys.stdout.write((prompt + text).decode("utf-8", errors="replace") + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
