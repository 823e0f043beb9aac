"""Reading a config: a YAML file plus ``dotted.key=value`` overrides, into a :class:`Config`.

Strict: safe YAML under size, depth and alias limits with duplicate keys refused
(:mod:`.strict_yaml`), unknown keys rejected with the closest valid key,
wrong types and out-of-range values rejected, each as one :class:`ConfigError`
naming the file (or "command line" when an override brought the value) and the
dotted key: exit code 2. Cross-key and file checks follow in :mod:`.checks`; every
problem of a config is reported at once, one line each (:class:`ConfigErrors`).
Torch-free, so the launcher validates a config in a fraction of a second before it
starts any worker.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml

from train.core.config import strict_yaml, types
from train.core.config.checks import validate
from train.core.config.origins import CLI, Sources, paths_in, within
from train.core.config.schema import Config, to_dict
from train.core.config.strict_yaml import clip, short
from train.core.errors import WHOLE_FILE, ConfigError, raise_all


def read_yaml(path: str | Path) -> dict:
    """Read a config file under :mod:`.strict_yaml`'s limits; every failure is a ConfigError."""
    path = Path(path)
    source = str(path)
    try:
        if path.exists() and not path.is_file() and not path.is_dir():
            # /dev/zero would be read forever, a FIFO wait for a writer
            raise ConfigError(source, WHOLE_FILE, "not a regular file (a device, FIFO or "
                                                  "socket); name a YAML file")
        if path.stat().st_size > strict_yaml.MAX_BYTES:  # do not even read it
            raise ConfigError(source, WHOLE_FILE, f"{path.stat().st_size / 2**20:.1f} MiB; a "
                                                  f"config is at most "
                                                  f"{strict_yaml.MAX_BYTES >> 20} MiB")
        with path.open("rb") as f:  # never more than the limit, whatever stat said
            raw = f.read(strict_yaml.MAX_BYTES + 1)
        if len(raw) > strict_yaml.MAX_BYTES:
            raise ConfigError(source, WHOLE_FILE, f"more than {strict_yaml.MAX_BYTES >> 20} MiB; "
                                                  "a config is at most that")
        text = raw.decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(source, WHOLE_FILE, "no such file" + _did_you_mean(path)) from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise ConfigError(source, WHOLE_FILE, f"cannot read: {exc.__class__.__name__}") from None
    try:
        data = strict_yaml.load(text)
    except strict_yaml.StrictYamlError as exc:
        raise ConfigError(source, exc.where, exc.problem) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(source, "<top>", "the file must hold a mapping of keys")
    if "apiVersion" in data and "kind" in data:
        raise ConfigError(source, WHOLE_FILE, _kubernetes_manifest(data))
    return data


def _kubernetes_manifest(data: dict) -> str:
    """What to say about a Kubernetes manifest given as the config (k8s/config.yaml is a
    ConfigMap that holds the training config under data.config.yaml)."""
    held = data.get("data")
    inside = [k for k, v in held.items() if str(k).endswith((".yaml", ".yml"))
              and isinstance(v, str)] if isinstance(held, dict) else []
    what = f"a Kubernetes {str(data['kind'])[:40]}, not a training config"
    if not inside:
        return what
    return (f"{what}; the training config is its data.{inside[0]} (kubectl apply mounts it in "
            f"the pods; to train with it here, save that value to a file of its own)")


def parse_override(text: str, source: str = CLI) -> tuple[str, Any]:
    """Split ``a.b=value``; the value is read as YAML (so ``[1, 2]``, ``true``, ``null``)."""
    dashed = dashed_override(text)
    if dashed is not None:
        raise dashed
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
    if isinstance(value, str) and any(c in raw for c in "\n\r"):
        value = raw  # YAML would fold its line breaks into spaces: keep what was typed
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


def top_level_keys() -> set[str]:
    return {key.name for key in types.keys(Config)}


def dashed_override(arg: str) -> ConfigError | None:
    """``--optim.lr=1e-3`` (or ``--optim.lr``): an override written as an option. The
    hint that overrides have no dashes, or None when ``arg`` does not look like one."""
    if not arg.startswith("-"):
        return None
    name, sep, value = arg.lstrip("-").partition("=")
    if not name or name.split(".")[0] not in top_level_keys():
        return None
    return ConfigError(CLI, clip(arg), f"overrides are written {clip(name)}="
                                       f"{clip(value) if sep else 'VALUE'} (without dashes)")


def _did_you_mean(path: Path) -> str:
    """``; did you mean X?`` for a config path that does not exist: near-misses in its
    own directory, then among the shipped configs (configs/*.yaml of this checkout or
    image)."""
    suggestions: list[str] = []
    try:
        here = [p.name for p in path.parent.iterdir()
                if p.suffix in (".yaml", ".yml") and p.is_file()]
    except OSError:
        here = []
    suggestions += [str(path.parent / n) if str(path.parent) != "." else n
                    for n in _near(path.name, here)]
    shipped_dir = Path(__file__).resolve().parents[3] / "configs"
    try:
        same_dir = path.parent.resolve() == shipped_dir.resolve()
    except OSError:
        same_dir = False
    if not same_dir:
        shipped = [p.name for p in shipped_dir.glob("*.yaml")]
        suggestions += [_shown(shipped_dir / n) for n in _near(path.name, shipped)]
    suggestions = list(dict.fromkeys(suggestions))[:2]
    return f"; did you mean {' or '.join(suggestions)}?" if suggestions else ""


def _near(name: str, candidates: list[str]) -> list[str]:
    """Up to two of ``candidates`` whose stem is close to ``name``'s (``quickstrat``,
    ``quickstart`` without .yaml) or starts with it (``gpt`` -> ``gpt-small``)."""
    stem = name.removesuffix(".yaml").removesuffix(".yml")
    stems = {c.rsplit(".", 1)[0]: c for c in sorted(candidates)}
    close = difflib.get_close_matches(stem, list(stems), n=2, cutoff=0.7)
    close += [s for s in stems if len(stem) >= 3 and s.startswith(stem)]
    return [stems[s] for s in dict.fromkeys(close)][:2]


def _shown(path: Path) -> str:
    """``path`` as the user can type it here: relative to the working directory when
    it lies below it, else absolute."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _unknown_key(source: str, prefix: str, key: str, valid: list[str]
                 ) -> tuple[ConfigError, str | None]:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"did you mean {prefix}{close[0]}?" if close else "valid keys: " + ", ".join(valid)
    return (ConfigError(source, clip(prefix + key), f"unknown key; {hint}"),
            prefix + close[0] if close else None)


def _misfit_hint(value: Any, tp: Any) -> str:
    """What may have been meant by a value that fits no allowed one."""
    if isinstance(value, bool) and types.shape(tp)[0] == "choice":
        # YAML 1.1 reads unquoted on/off/yes/no as true/false
        return " (YAML reads an unquoted on, off, yes or no as true or false)"
    meant = types.closest_choice(value, tp)
    return f"; did you mean {meant}?" if meant else ""


def build(cls: type, data: Any, sources: Sources, prefix: str = "",
          errors: list[ConfigError] | None = None, bad: set[str] | None = None) -> Any:
    """A section from its mapping, converting and checking every value.

    Every problem is added to ``errors`` (the value keeps its default) and its key to
    ``bad``, so that the checks across keys can leave alone what they would misjudge;
    without ``errors``, the problems are raised at the end.
    """
    collect = errors is not None
    errors = [] if errors is None else errors
    bad = set() if bad is None else bad
    section = prefix.rstrip(".")
    if not isinstance(data, dict):
        errors.append(ConfigError(sources.of(section), section or "<top>",
                                  f"must be a mapping, got {type(data).__name__}"))
        bad.add(section)
        data = {}
    fields = {k.name: k for k in types.keys(cls)}
    kwargs = {}
    for name, value in data.items():
        name, dotted = str(name), prefix + str(name)
        key = fields.get(name)
        if key is None:
            error, meant = _unknown_key(sources.of(dotted), prefix, name, list(fields))
            errors.append(error)
            bad.update([dotted, *([meant] if meant else [])])
            continue
        if key.section is not None:
            kwargs[name] = build(key.section, value if value is not None else {}, sources,
                                 dotted + ".", errors, bad)
            continue
        got = types.coerce(value, key.type, sources.from_cli(dotted))
        if got is types.NO:
            errors.append(ConfigError(sources.of(dotted), dotted, f"got {short(value)}; "
                                      f"expected {types.describe(key.type)}"
                                      f"{_misfit_hint(value, key.type)}"))
            bad.add(dotted)
            continue
        problem = types.bounds_problem(got, key.bounds)
        if problem:
            errors.append(ConfigError(sources.of(dotted), dotted,
                                      f"got {short(value)}; {problem}"))
            bad.add(dotted)
            continue
        kwargs[name] = got
    if not collect:
        raise_all(errors)
    return cls(**kwargs)


def _apply_overrides(tree: dict, overrides: list[str], errors: list[ConfigError],
                     bad: set[str], in_file: set[str]) -> set[str]:
    """Set each ``key=value`` in ``tree``; the paths they set (those no longer the file's
    leave ``in_file``). Problems go to ``errors``."""
    overridden: set[str] = set()
    for text in overrides:
        try:
            key, value = parse_override(text)
            set_dotted(tree, key, value)
        except ConfigError as exc:
            errors.append(exc)
            bad.add(text.lstrip("-").partition("=")[0].strip())
            continue
        replaced = {p for p in overridden | in_file if within(p, key)}
        overridden -= replaced
        in_file -= replaced
        overridden |= {key} | paths_in(value, key + ".")
    return overridden


def _finish(tree: dict, sources: Sources, errors: list[ConfigError], bad: set[str],
            run_name: str | None = None) -> Config:
    """Build and validate; every problem found at once (one line each), exit 2."""
    cfg = build(Config, tree, sources, "", errors, bad)
    if cfg.run.name is None and run_name is not None:
        cfg.run.name = run_name
    cfg._sources = sources
    validate(cfg, sources, errors, bad)
    raise_all(errors)
    return cfg


def load_config(path: str | Path, overrides: list[str] = (), *,
                source: str | None = None) -> Config:
    """Load, override, validate. Raises ConfigError (exit 2) on anything invalid: every
    problem of the config at once (:class:`~train.core.errors.ConfigErrors`) when there are
    several. Adjustments made with a warning: :func:`config_warnings`.

    source: the file messages name and run.name defaults to, when ``path`` is a copy
    of it (a worker reads the config its launch validated, not the file again)."""
    tree = read_yaml(path)
    in_file = paths_in(tree)
    errors: list[ConfigError] = []
    bad: set[str] = set()
    overridden = _apply_overrides(tree, list(overrides), errors, bad, in_file)
    named = source or str(path)
    return _finish(tree, Sources(named, overridden, in_file), errors, bad,
                   run_name=Path(named).stem)


def load_overrides(overrides: list[str], defaults: dict[str, Any]) -> Config:
    """A config from defaults and ``key=value`` overrides alone, without a file
    (``entrypoint.py launch``: the distributed.* keys of a script's launch)."""
    tree: dict = {}
    for key, value in defaults.items():
        set_dotted(tree, key, value)
    errors: list[ConfigError] = []
    bad: set[str] = set()
    overridden = _apply_overrides(tree, list(overrides), errors, bad, set())
    return _finish(tree, Sources(CLI, overridden), errors, bad)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
