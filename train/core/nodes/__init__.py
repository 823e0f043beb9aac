"""Judging nodes by what their ranks measured, torch-free and pure: the preflight
check's verdict (:mod:`.verdict`: every rank's measurements in, the lines rank 0 prints
out) and its link rule (:mod:`.link_rule`: which node pairs to time, which node to name).
The measuring, with torch, is :mod:`train.guards.preflight`'s and :mod:`train.guards.links`'."""
