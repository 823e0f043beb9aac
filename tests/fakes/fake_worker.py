"""A stand-in training worker for supervisor tests (started directly or by torchrun).

``fake_worker.py MODE``: ok | fail-rank-1 | sigterm | crash. Reports like
train.worker does; in sigterm mode it marks itself ready in $FAKE_READY_DIR,
waits for SIGTERM/SIGINT and exits 143 as the real worker does after its checkpoint.
"""

import os
import signal
import sys
import time

from train.core.run.protocol import Reporter

mode = sys.argv[1]
reporter = Reporter.from_environ()
rank = reporter.ident.rank
write_status = reporter.ended
if mode == "ok":
    write_status(0, None)
    sys.exit(0)
if mode == "fail-rank-1":
    if rank == 1:
        write_status(1, "RuntimeError: boom on rank 1")
        sys.exit(1)
    time.sleep(60)  # torchrun stops the others when one fails
    sys.exit(0)
if mode == "crash":
    os._exit(7)  # dies without a report (like SIGKILL / out of memory)
if mode == "sigterm":
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    open(os.path.join(os.environ["FAKE_READY_DIR"], f"ready-{rank}"), "w").close()
    deadline = time.monotonic() + 60
    while not stop and time.monotonic() < deadline:
        time.sleep(0.02)
    write_status(143 if stop else 1, None if stop else "TimeoutError: no signal came")
    sys.exit(143 if stop else 1)
sys.exit(f"unknown mode {mode}")
