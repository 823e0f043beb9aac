"""The torch-free core: what the launcher and the workers share.

The launcher (``launcher/``, the parent process) imports nothing from ``train`` but
this package, and nothing here imports torch or numpy at module level, so the parent
validates a config, checks the run directory and plans a launch in a fraction of a
second, and ``entrypoint.py --help`` answers at once. ``tests/static/test_layout.py`` holds
both rules.

Its sub-rooms, one concern each:

- :mod:`.config`: the typed config, its reading and checks, the kind registry, the
  experiment trackers' settings;
- :mod:`.run`: the run directory and its lease, a worker's identity, and the launcher <->
  worker protocol;
- :mod:`.machine`: the host's CPUs and memory, placement (backend, processes), threads,
  communication variables, where store servers listen;
- :mod:`.user`: the user's own code, read by the launcher and imported by the workers;
- :mod:`.datasets`: the files behind each ``data.kind``;
- :mod:`.nodes`: the preflight check's verdict and link rule.

At the top, what every sub-room uses: :mod:`.errors` (exit codes and the one-line errors
behind them), :mod:`.files` (crash-safe writes, digests) and :mod:`.bulk` (large files at
the disk's speed); and the object-storage settings, lease and credentials
(:mod:`.remote_config`, :mod:`.remote_lease`, :mod:`.credentials`).
"""
