"""Running: one pipeline from a command to a supervised child (prepare, execute,
supervise), the processes it starts, the signals it forwards and SLURM's requeue.
"""
