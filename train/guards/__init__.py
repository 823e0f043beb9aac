"""What keeps a run from going on wrong: the stop agreement after a signal
(:mod:`.stopping`), the hang watchdog that names a rank making no progress
(:mod:`.watchdog`), and the divergence guard that never lets a non-finite step or
weight through (:mod:`.divergence`).
"""
