"""The torch-free core: what the launcher and the workers share.

The launcher (``launcher/``, the parent process) imports nothing from ``train`` but
this package, and nothing here imports torch or numpy at module level, so the parent
validates a config, checks the run directory and plans a launch in a fraction of a
second, and ``entrypoint.py --help`` answers at once. ``tests/static/test_layout.py`` holds
both rules.

- :mod:`.errors`: exit codes and the one-line errors behind them;
- :mod:`.config`: the typed config, its loader and checks, the kind registry;
- :mod:`.placement`: which backend, how many processes, which settings need a GPU;
- :mod:`.identity`: a worker's rank, world size and launcher settings, from its
  environment; :mod:`.comm_defaults`: the communication variables a worker needs;
  :mod:`.threads`: its CPU threads and how they wait;
- :mod:`.protocol`: what a worker tells the launcher (its progress, how it ended) and
  what a restart can fix;
- :mod:`.rundir`: every name in the run directory, and reading its checkpoints;
- :mod:`.runlock`, :mod:`.files`, :mod:`.host`, :mod:`.datafiles`, :mod:`.usercode`,
  :mod:`.tracker_config`: the run directory's lock, atomic files, the machine, data
  files, the user's code, the experiment trackers' settings.
"""
