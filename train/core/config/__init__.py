"""Typed training configuration, strictly validated, torch-free.

- :mod:`.schema`: the dataclasses (one per component) with each key's doc and bounds;
- :mod:`.types`: one walker over the schema's types (loader, JSON Schema, docs/config.md);
- :mod:`.reading`: YAML file + ``dotted.key=value`` overrides -> :class:`Config`;
- :mod:`.origins`: where each value came from (file, command line, default);
- :mod:`.checks`: cross-key and file checks, batch arithmetic, resume compatibility;
- :mod:`.kinds`: each ``model.kind`` and ``data.kind`` with its builder and its own rules;
- :mod:`.reference`: the generated key reference (``--help-config``, docs, JSON Schema);
- :mod:`.tracking`: which experiment trackers a config turns on, and their checks.

Every problem is a :class:`~train.core.errors.ConfigError` (exit 2) with one line naming
the file or "command line" (where the key's value came from), the dotted key, what is
wrong and what is allowed; a config's problems are reported all at once
(:class:`~train.core.errors.ConfigErrors`). Values adjusted with a warning (a warmup longer
than the run): :func:`~.origins.config_warnings`.
"""

from train.core.config.checks import batch_split
from train.core.config.reading import load_config, parse_override, to_yaml
from train.core.config.resume import check_checkpoint_config, check_resume_compatible
from train.core.config.schema import (
                                 AUTO,
                                 CheckpointConfig,
                                 Config,
                                 DataConfig,
                                 DistributedConfig,
                                 LoggingConfig,
                                 MemoryConfig,
                                 ModelConfig,
                                 OptimConfig,
                                 OutputConfig,
                                 RunConfig,
                                 ScheduleConfig,
                                 TrainLoopConfig,
                                 to_dict,
)

__all__ = ["AUTO", "CheckpointConfig", "Config", "DataConfig", "DistributedConfig",
           "LoggingConfig", "MemoryConfig", "ModelConfig", "OptimConfig", "OutputConfig",
           "RunConfig", "ScheduleConfig", "TrainLoopConfig", "batch_split",
           "check_checkpoint_config", "check_resume_compatible", "load_config",
           "parse_override", "to_dict", "to_yaml"]
