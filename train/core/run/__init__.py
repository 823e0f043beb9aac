"""A run: its directory, its lease, and what its workers tell the launcher.

- :mod:`.rundir`: every fixed name in the run directory, and reading its checkpoints;
- :mod:`.runlock`: one run directory, one job (a lease taken before training writes);
- :mod:`.identity`: a worker's rank, world size and launcher settings, from its
  environment;
- :mod:`.protocol` and its records, :mod:`.reports`: what a supervised process tells the
  launcher (its progress, how it ended) and what a restart can fix;
- :mod:`.failure_log`: a rank's failure, said once on the console; :mod:`.peers`: a rank
  that failed only because another died.
"""
