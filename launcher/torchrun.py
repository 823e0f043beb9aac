"""torchrun, as the launcher runs it: ``python -m launcher.torchrun`` takes torchrun's
arguments, and differs in one way only.

Stopped by a signal (SIGTERM from Kubernetes, systemd, ``timeout``, a forwarded
Ctrl-C), torchrun forwards it to the workers, which checkpoint and exit, and then
dies with a 25-line ``SignalException`` traceback, in every run. The signal is the
normal way a job ends early, so here it ends with ``128 + signal`` and one line; the
launcher reads the workers' reports and says the rest.
"""

from __future__ import annotations

import signal
import sys


def main() -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main
    try:
        torchrun_main()
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        print(f"torchrun: stopped by {name}; workers were told to checkpoint and exit",
              file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
