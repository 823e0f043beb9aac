"""What torchrun's agent as the launcher runs it (``python -m launcher.torchrun``) and
the launcher that starts it agree on: the exit status for a lost rendezvous store and
the variable that hands the agent its rendezvous local id.

Kept apart from :mod:`launcher.torchrun` (a process entry that loads torch) so that the
supervisor and the endings can name them without importing the agent, and the agent
can word its restarts (:mod:`launcher.endings.restarts`) without an import circle.
"""

from __future__ import annotations

# Exit status meaning "the rendezvous store is unreachable" (EX_TEMPFAIL).
STORE_LOST = 75
# The rendezvous local id this torchrun presents, chosen by the launcher (which then
# knows which member of a round is its own node); random when unset.
LOCAL_ID_VAR = "TRAIN_RDZV_LOCAL_ID"
