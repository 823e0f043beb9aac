"""Launch conventions: how the environment says that this node is part of a job.

Each convention is one module here with

- ``NAME``: what ``--dry-run`` and ``doctor`` call it;
- ``detect(env) -> bool``: does the environment use this convention?
- ``nodes(env, timings) -> Nodes``: the node range, torchrun's rendezvous flags, the worker
  variables it needs, and the host that must resolve before starting.
- optionally ``VARIABLES_FALL_BACK = True`` when its variables stand in for one another
  (SLURM's): then only its first bad variable is said, not every one at once.

The first module in :data:`ORDER` whose ``detect`` is true wins; :mod:`.single` (one
node, nothing special) is the fallback. Each module reads its own variables, from the
frozen :class:`~launcher.planning.variables.Environ` mapping. Adding a convention (MPI, a
JobSet) means one module, one entry in ORDER and one golden plan test
(tests/unit/test_launcher_plan.py).
"""

from __future__ import annotations

from dataclasses import replace
from types import ModuleType

from launcher.conventions import indexed_job, kubeflow_v1, single, slurm, torchrun_env
from launcher.conventions.common import DEFAULT_RDZV_PORT, Nodes, Timings
from launcher.planning.variables import Environ
from train.core.errors import ConfigError, raise_all

DEFAULT_TIMINGS = Timings()  # torchrun's rendezvous timeouts as this project sets them

# torchrun's own variables first: an elastic PyTorchJob also sets MASTER_ADDR & co. Inside
# a SLURM job, variables the user set for torchrun or the store win; SLURM comes before
# MASTER_ADDR/WORLD_SIZE/RANK, which sbatch scripts often export for other launchers.
ORDER: tuple[ModuleType, ...] = (torchrun_env, indexed_job, slurm, kubeflow_v1)

__all__ = ["DEFAULT_RDZV_PORT", "ORDER", "Nodes", "Timings", "detect", "resolve",
           "variable_errors"]


def detect(env: Environ) -> ModuleType:
    return next((c for c in ORDER if c.detect(env)), single)


def resolve(env: Environ, timings: Timings = DEFAULT_TIMINGS) -> Nodes:
    """The convention's nodes; ConfigError naming every malformed variable at once."""
    convention = detect(env)
    try:
        return convention.nodes(env, timings)
    except ConfigError:
        raise_all(variable_errors(env, timings))
        raise


def variable_errors(env: Environ, timings: Timings = DEFAULT_TIMINGS) -> list[ConfigError]:
    """Every malformed variable of the convention ``env`` uses, not only the first: a
    convention stops at its first problem, so it is asked again without the variables
    named so far (a problem of a variable already named is not said twice). Not one
    whose variables fall back to one another (``VARIABLES_FALL_BACK``: SLURM's step and
    job variables): there only the first problem is said."""
    convention, errors = detect(env), []
    tries = 1 if getattr(convention, "VARIABLES_FALL_BACK", False) else len(env.raw)
    for _ in range(tries):
        try:
            convention.nodes(env, timings)
            break
        except ConfigError as exc:
            named = {e.key for e in errors}
            errors += [e for e in getattr(exc, "errors", [exc]) if e.key not in named]
        except (AttributeError, LookupError, TypeError, ValueError):
            break  # without a variable it relies on, a convention meets None or nothing
        dropped = {e.key for e in errors} & set(env.raw)
        if not dropped:  # a variable that is missing: nothing more to learn without it
            break
        env = replace(env, raw={k: v for k, v in env.raw.items() if k not in dropped})
    return errors
