"""The tokenizer a run trained with, carried into its transformers export.

A ``data.kind: tokens`` run on files ``entrypoint.py tokenize`` wrote knows its tokenizer:
each token file's ``FILE.json`` names the ``tokenizer.json`` it was made with (its path
and SHA-256) and the ``--eos`` token put after each file. :func:`locate` finds it (every
local token file of ``data.path`` must name the same one; the run's manifest.json, when
it recorded one, must agree; the file must still hash as it did), and
:meth:`Tokenizer.write` copies it into the export with the tokenizer files beside it
(``tokenizer_config.json`` and the others ``save_pretrained`` writes), so
``AutoTokenizer.from_pretrained(export)`` reads it. :meth:`Tokenizer.special_ids` are the
ids of its special tokens (eos: the ``--eos`` token), which the export's config.json and
generation_config.json take.

Anything else (byte-level text, token files made otherwise, objects in a store, a
tokenizer changed since) exports no tokenizer, and :func:`locate` says why in one line.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from train.core.run import rundir

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
# What a tokenizer folder holds beside tokenizer.json (save_pretrained's files, and the
# slow tokenizers' vocabularies), copied into the export when there
COMPANIONS = (CONFIG_FILE, "special_tokens_map.json", "added_tokens.json",
              "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")
TOKENIZER_FILES = (TOKENIZER_FILE, *COMPANIONS)
SPECIAL = ("bos", "eos", "pad")
MANIFEST_HASH = re.compile(r"tokenizer\.json sha256 ([0-9a-f]{64})")


@dataclass
class Tokenizer:
    file: Path            # the tokenizer.json tokenize read
    data: bytes           # its bytes, as hashed
    sha256: str
    eos: str | None       # tokenize --eos

    def _config(self) -> dict:
        """tokenizer_config.json: the folder's own when tokenize read a folder's
        tokenizer.json, else the fast tokenizer of tokenizer.json alone; the --eos token
        is its eos_token unless it names one."""
        own = self.file.parent / CONFIG_FILE
        config = {}
        if self.file.name == TOKENIZER_FILE and own.is_file():
            try:
                config = json.loads(own.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                config = {}
        if not isinstance(config, dict) or not config:
            config = {"tokenizer_class": "PreTrainedTokenizerFast"}
        if self.eos is not None and not config.get("eos_token"):
            config["eos_token"] = self.eos
        return config

    def special_ids(self) -> dict[str, int | None]:
        """``bos_token_id``, ``eos_token_id``, ``pad_token_id``: the ids of the
        tokenizer's special tokens (eos: tokenize's --eos), None where it has none."""
        from tokenizers import Tokenizer as Rust
        vocab = Rust.from_str(self.data.decode("utf-8"))
        config = self._config()
        tokens = {name: config.get(f"{name}_token") for name in SPECIAL}
        if self.eos is not None:
            tokens["eos"] = self.eos
        ids = {}
        for name, token in tokens.items():
            if isinstance(token, dict):  # an AddedToken, as save_pretrained writes one
                token = token.get("content")
            ids[f"{name}_token_id"] = vocab.token_to_id(token) if isinstance(token, str) \
                else None
        return ids

    def write(self, folder: Path) -> list[str]:
        """tokenizer.json (the bytes hashed), tokenizer_config.json and the folder's other
        tokenizer files into ``folder``; their names."""
        (folder / TOKENIZER_FILE).write_bytes(self.data)
        (folder / CONFIG_FILE).write_text(json.dumps(self._config(), indent=2,
                                                     ensure_ascii=False) + "\n",
                                          encoding="utf-8")
        names = [TOKENIZER_FILE, CONFIG_FILE]
        if self.file.name == TOKENIZER_FILE:  # a folder's: its companions are its own
            for name in COMPANIONS[1:]:
                if (self.file.parent / name).is_file():
                    shutil.copyfile(self.file.parent / name, folder / name)
                    names.append(name)
        return names

    def describe(self) -> dict:
        """model.json's record of it."""
        return {"source": str(self.file), "sha256": self.sha256, "eos": self.eos}


def locate(config: dict, run_dir: Path) -> tuple[Tokenizer | None, str | None]:
    """The tokenizer that made the run's token files, or None and why (None when there
    is nothing to say: data that is not token files)."""
    from train.core.datasets import tokenfiles
    from train.core.errors import ConfigError
    from train.data.tokenfile import read_sidecar
    data = config.get("data") or {}
    if data.get("kind") != "tokens":
        return None, None
    if tokenfiles.is_remote(data.get("path")):
        return None, ("data.path names objects in a store, whose FILE.json export does not "
                      "read; copy the tokenizer into the export yourself")
    try:
        files = tokenfiles.resolve(data.get("path"), "the run's config")
    except ConfigError as exc:  # a file not here (a relative path, another machine)
        return None, (f"data.path: {exc.problem}; export from the folder the run was "
                      "started in to carry its tokenizer")
    made = [(read_sidecar(Path(f.name)) or {}) for f in files]
    named = {json.dumps([m.get("tokenizer"), m.get("eos")], sort_keys=True) for m in made}
    if len(named) > 1:
        return None, ("data.path's token files were not all made by one tokenizer (their "
                      "FILE.json)")
    record, eos = made[0].get("tokenizer"), made[0].get("eos")
    if not (isinstance(record, dict) and isinstance(record.get("path"), str)
            and isinstance(record.get("sha256"), str)):
        return None, ("data.path's token files name no tokenizer (no FILE.json from "
                      "entrypoint.py tokenize beside them)")
    return _read(Path(record["path"]), record["sha256"], eos if isinstance(eos, str) else None,
                 run_dir)


def _read(file: Path, sha256: str, eos: str | None,
          run_dir: Path) -> tuple[Tokenizer | None, str | None]:
    """The tokenizer file, if it is still the one the token files and the run name."""
    import hashlib
    try:
        manifest = json.loads((run_dir / rundir.MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        manifest = {}
    trained = MANIFEST_HASH.search(str(manifest.get("data", ""))) \
        if isinstance(manifest, dict) else None
    if trained and trained.group(1) != sha256:
        return None, (f"the token file was made again, with another tokenizer, since the run "
                      f"read it (manifest.json: tokenizer.json sha256 {trained.group(1)})")
    try:
        data = file.read_bytes()
    except OSError as exc:
        return None, f"{file}: cannot read the run's tokenizer ({exc.strerror or exc})"
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        return None, (f"{file} changed since the token files were made (sha256 {digest}, "
                      f"tokenize recorded {sha256})")
    return Tokenizer(file, data, sha256, eos), None
