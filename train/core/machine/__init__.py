"""The machine a run's processes go on, decided alike by the launcher and the worker.

- :mod:`.host`: the CPUs this process may use, the image's build manifest, memory left;
- :mod:`.placement`: which backend a device gets, how many processes, which settings
  need a GPU;
- :mod:`.threads`: a rank's CPU threads and how its idle ones wait;
- :mod:`.comm_defaults`: the communication variables a worker needs before torch talks;
- :mod:`.binding`: store servers listening only where their clients connect.
"""
