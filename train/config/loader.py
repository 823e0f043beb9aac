"""Reading a config: a YAML file plus ``dotted.key=value`` overrides, into a :class:`Config`.

Strict: safe YAML under size, depth and alias limits with duplicate keys refused
(:mod:`.strict_yaml`), unknown keys rejected with the closest valid key,
wrong types and out-of-range values rejected, each as one :class:`ConfigError`
naming the file (or "command line" when an override brought the value) and the
dotted key: exit code 2. Cross-key and file checks follow in :mod:`.checks`.
Torch-free, so the launcher validates a config in a fraction of a second before it
starts any worker.
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any

import yaml

from train.config import strict_yaml, types
from train.config.schema import Config
from train.config.strict_yaml import clip, short
from train.errors import ConfigError

CLI = "command line"


def read_yaml(path: str | Path) -> dict:
    """Read a config file under :mod:`.strict_yaml`'s limits; every failure is a ConfigError."""
    path = Path(path)
    source = str(path)
    try:
        if path.stat().st_size > strict_yaml.MAX_BYTES:  # do not even read it
            raise ConfigError(source, "<file>", f"{path.stat().st_size / 2**20:.1f} MiB; a "
                                                f"config is at most "
                                                f"{strict_yaml.MAX_BYTES >> 20} MiB")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(source, "<file>", "no such file") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise ConfigError(source, "<file>", f"cannot read: {exc.__class__.__name__}") from None
    try:
        data = strict_yaml.load(text)
    except strict_yaml.StrictYamlError as exc:
        raise ConfigError(source, exc.where, exc.problem) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(source, "<top>", "the file must hold a mapping of keys")
    return data


def parse_override(text: str, source: str = CLI) -> tuple[str, Any]:
    """Split ``a.b=value``; the value is read as YAML (so ``[1, 2]``, ``true``, ``null``)."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(source, clip(text), "overrides look like dotted.key=value")
    try:
        value = strict_yaml.load(raw) if raw.strip() else ""
    except strict_yaml.StrictYamlError as exc:
        if exc.problem.startswith("invalid YAML"):
            value = raw  # not YAML: the plain string
        else:
            raise ConfigError(source, key.strip(), exc.problem) from None
    return key.strip(), value


def set_dotted(tree: dict, key: str, value: Any, source: str = CLI) -> None:
    node = tree
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(source, ".".join(parts[: i + 1]), "is a value, not a section")
        node = child
    node[parts[-1]] = value


class Sources:
    """Where each value came from: the file, or the command line for overridden keys."""

    def __init__(self, file: str, overridden: set[str] = frozenset()) -> None:
        self.file, self.overridden = file, set(overridden)

    def of(self, *dotted: str) -> str:
        """The command line when any of these keys was overridden there, else the file."""
        return CLI if any(k in self.overridden for k in dotted) else self.file


def _unknown_key(source: str, prefix: str, key: str, valid: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"did you mean {prefix}{close[0]}?" if close else "valid keys: " + ", ".join(valid)
    return ConfigError(source, clip(prefix + key), f"unknown key; {hint}")


def build(cls: type, data: Any, sources: Sources, prefix: str = "") -> Any:
    """A section from its mapping, converting and checking every value."""
    if not isinstance(data, dict):
        raise ConfigError(sources.of(prefix.rstrip(".")), prefix.rstrip(".") or "<top>",
                          f"must be a mapping, got {type(data).__name__}")
    fields = {k.name: k for k in types.keys(cls)}
    kwargs = {}
    for name, value in data.items():
        name, dotted = str(name), prefix + str(name)
        key = fields.get(name)
        if key is None:
            raise _unknown_key(sources.of(dotted), prefix, name, list(fields))
        if key.section is not None:
            kwargs[name] = build(key.section, value if value is not None else {}, sources,
                                 dotted + ".")
            continue
        got = types.coerce(value, key.type, dotted in sources.overridden)
        if got is types.NO:
            raise ConfigError(sources.of(dotted), dotted,
                              f"got {short(value)}; expected {types.describe(key.type)}")
        problem = types.bounds_problem(got, key.bounds)
        if problem:
            raise ConfigError(sources.of(dotted), dotted, f"got {short(value)}; {problem}")
        kwargs[name] = got
    return cls(**kwargs)


def load_config(path: str | Path, overrides: list[str] = ()) -> Config:
    """Load, override, validate. Raises ConfigError (exit 2) on anything invalid."""
    from train.config.checks import validate
    tree = read_yaml(path)
    overridden = set()
    for text in overrides:
        key, value = parse_override(text)
        set_dotted(tree, key, value)
        overridden.add(key)
    sources = Sources(str(path), overridden)
    cfg = build(Config, tree, sources)
    if cfg.run.name is None:
        cfg.run.name = Path(path).stem
    validate(cfg, sources)
    return cfg


def load_overrides(overrides: list[str], defaults: dict[str, Any]) -> Config:
    """A config from defaults and ``key=value`` overrides alone, without a file
    (``entrypoint.py launch``: the distributed.* keys of a script's launch)."""
    from train.config.checks import validate
    tree: dict = {}
    for key, value in defaults.items():
        set_dotted(tree, key, value)
    overridden = set()
    for text in overrides:
        key, value = parse_override(text)
        set_dotted(tree, key, value)
        overridden.add(key)
    sources = Sources(CLI, overridden)
    cfg = build(Config, tree, sources)
    validate(cfg, sources)
    return cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
