"""Liveness: how a launcher tells a lost node from a slow one (the static job's
heartbeat, the elastic job's pulse and rendezvous rounds), behind one interface the
plan chooses (:mod:`launcher.liveness.watchers`).
"""
