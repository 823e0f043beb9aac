"""Whether a config may resume its run: checkpoints that exist must be usable, and the
keys that shape the checkpoints (:data:`RESUME_KEYS`) must not have changed; any other
change is a warning naming each key, so a rerun with an edited config never changes
the run silently. Torch-free: the launcher checks before any worker starts, the worker
again against the checkpoint's own copy of the config.
"""

from __future__ import annotations

import logging
from pathlib import Path

import yaml

from train.core.config.origins import MISSING, dig, origin_note, show
from train.core.config.schema import AUTO, Config, to_dict
from train.core.errors import ConfigError, DataChanged
from train.core.run import rundir
from train.core.storage.credentials import redacted

log = logging.getLogger("train")

# Keys whose change makes a run's checkpoints unloadable (parameter or optimizer-state
# shapes, or what the inputs mean).
RESUME_KEYS = ("model.kind", "model.depth", "model.width", "model.heads", "model.context_length",
               "model.tie_weights", "model.factory", "model.args", "data.kind",
               "data.vocab_size", "data.shape", "data.num_classes", "optim.name")


def check_checkpoint_config(cfg: Config, saved: dict, where: Path | str, source: str) -> None:
    """ConfigError (exit 2) naming the first resume key that differs from `saved` (the
    resolved config a run or checkpoint was written with). Keys the saved config does
    not have (written by an older version) are not compared."""
    new = to_dict(cfg)
    # what the run was saved with may hold a credential (an older version saved it)
    changed = [f"{key} {redacted(dig(saved, key))!r} -> {redacted(dig(new, key))!r}"
               for key in RESUME_KEYS
               if dig(saved, key) is not MISSING and dig(saved, key) != dig(new, key)]
    if changed:
        raise ConfigError(source, changed[0].split()[0],
                          f"differs from the run being resumed ({where}: "
                          f"{'; '.join(changed[:3])}); use a new run.name, or "
                          f"checkpoint.resume_from=none to start this run over")


def check_same_data(cfg: Config, saved: str | None, now: str, where: Path | str,
                    source: str) -> None:
    """DataChanged (exit 2) when the checkpoint being resumed trained on other data than
    ``now`` (its ``data_sha256``; None: written before checkpoints recorded it), unless
    ``data.allow_changed`` says to go on, which is then said in a warning."""
    if saved is None or saved == now:
        return
    differs = f"data_sha256 {saved[:16]}... in {where}, {now[:16]}... now"
    if cfg.data.allow_changed:
        log.warning("resuming on other data than the checkpoint trained on (%s): "
                    "data.allow_changed is on", differs)
        return
    key = "data.factory" if cfg.data.kind == "custom" else "data.path"
    raise DataChanged(f"{source}: {key}: differs from the data the run being resumed "
                      f"trained on ({differs}); put the data back as it was, start a new "
                      "run (another run.name), or set data.allow_changed=true to go on "
                      "with this data")


# Keys a rerun may change without a word: what the launcher decides for the worker
# (auto becomes cpu/gpu, nccl/gloo) and where the run directory is named from.
UNCOMPARED_KEYS = ("device", "distributed.backend", "output.dir", "run.name")


def check_resume_compatible(cfg: Config, source: str) -> None:
    """A config that would resume a run whose checkpoints it cannot load is bad input.

    Before any worker starts: checkpoints present but none with its files is refused
    (exit 2, never a silent start from step 0); then the config is compared with the run
    directory's config.yaml (written once a start has loaded its checkpoint, so it
    matches the checkpoints' shapes): a change of a :data:`RESUME_KEYS` key is exit 2,
    any other change a warning naming each key (:func:`~.origins.config_warnings`), so a
    rerun with an edited config never changes the run silently. A damaged config.yaml
    is a warning too (this start rewrites it). The worker checks the checkpoint's own
    copy again when it loads it.
    """
    run_dir = cfg.run_dir
    if cfg.checkpoint.resume_from != AUTO:
        return
    problem = rundir.usable_problem(run_dir / rundir.CHECKPOINTS)
    if problem:  # checkpoints there, none whole: never start over silently
        raise ConfigError(source, "checkpoint.resume_from", problem)
    if not (run_dir / rundir.CHECKPOINTS / rundir.LATEST).exists():
        return
    saved, damage = recorded_config(run_dir)
    if damage:
        _warn(cfg, f"{run_dir / rundir.CONFIG}: {damage}; this start rewrites it (the "
                   "checkpoint's own copy of the config is checked instead)")
    if saved is None:
        return
    check_checkpoint_config(cfg, saved, run_dir, source)
    changed = changed_keys(saved, to_dict(cfg))
    if changed:
        shown = "; ".join(f"{k} {show(redacted(dig(saved, k)))} -> "
                          f"{show(redacted(dig(to_dict(cfg), k)))}"
                          f"{origin_note(cfg, k, source)}" for k in changed[:5])
        more = f"; and {len(changed) - 5} more" if len(changed) > 5 else ""
        _warn(cfg, f"{source}: resuming {run_dir} with a config that differs from the one it "
                   f"ran with ({run_dir / rundir.CONFIG}): {shown}{more}")


def recorded_config(run_dir: Path) -> tuple[dict | None, str | None]:
    """The run's config.yaml as a mapping, or (None, what is wrong with it)."""
    path = run_dir / rundir.CONFIG
    try:
        saved = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, None
    except UnicodeDecodeError:
        return None, "not UTF-8 text (damaged)"
    except (OSError, yaml.YAMLError) as exc:
        return None, f"unreadable ({type(exc).__name__})"
    if not isinstance(saved, dict):
        return None, "not a mapping of keys (damaged)"
    return saved, None


def changed_keys(saved: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose value differs (keys only one side has are left out: another
    version of this project wrote the other)."""
    out = []
    for key, value in new.items():
        dotted = f"{prefix}{key}"
        if dotted in UNCOMPARED_KEYS or key not in saved:
            continue
        if isinstance(value, dict) and isinstance(saved[key], dict) and \
                dotted not in ("model.args", "data.args"):
            out += changed_keys(saved[key], value, dotted + ".")
        elif saved[key] != value:
            out.append(dotted)
    return out


def _warn(cfg: Config, message: str) -> None:
    cfg._warnings = [*getattr(cfg, "_warnings", []), message]
