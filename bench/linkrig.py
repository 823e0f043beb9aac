"""The rig of bench/tokenobjects_link.py: an S3 server on a host of its own behind a
shaped link, and a node that reads from it (hosts in network namespaces on one bridge,
tests/harness/netns.py; needs root).

The store host runs SeaweedFS (tests/harness/s3server.py, bound to its own address) and
holds the objects; what it sends (the data) is shaped to :data:`RATE` by the kernel's
token bucket (tbf). The round trip gets :data:`DELAY_MS`: from netem where the kernel
has it (``netem delay 20ms rate 1gbit``, on the store's side, instead of tbf); else from
tests/harness/delaylink.py, a relay that holds each packet the node sends to the store
(requests, ACKs) for that long. Every process is stopped by its process group (a host's
PID namespace goes with it) and every namespace deleted when the rig closes, whatever
ends the bench (Ctrl-C and SIGTERM included).

    python -m bench.linkrig store HOME ADDR FILES MIB   # the store's own process
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

from tests.harness import netns, s3server
from tests.harness.multinode import Process
from tests.harness.runs import ROOT, worker_env

RATE = "1gbit"
RATE_MIB_S = 1e9 / 8 / (1 << 20)   # 119.2 MiB/s
DELAY_MS = 20
TOKENS = "tokens"


class Rig(netns.Rig):
    """The two hosts, the link between them, the store running; :meth:`close` undoes it."""

    def __init__(self, work: Path) -> None:
        super().__init__(work)
        self.shaping = ""
        self.endpoint = ""

    def start(self, files: int, mib: int) -> None:
        net = self.network()
        self.store, self.node = net.host("store"), net.host("node")
        store = self._run(self.store, "s3", ["-m", "bench.linkrig", "store",
                                             str(self.work / "s3"), self.store.addr,
                                             str(files), str(mib)])
        self.endpoint = store.wait_for(r"ready (\S+)", 600)[1]
        self.shaping = self._shape()

    def _shape(self) -> str:
        tc = self.net.tc
        netem = tc(self.store, "qdisc", "add", "dev", "eth0", "root", "netem", "delay",
                   f"{DELAY_MS}ms", "rate", RATE, "limit", "100000")
        if netem.returncode == 0:
            return f"netem delay {DELAY_MS}ms rate {RATE} on the store's interface"
        # a burst of 256 KiB passes the sender's 64 KiB segments whole; a queue of 50 ms
        tbf = tc(self.store, "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", RATE,
                 "burst", "256kb", "latency", "50ms")
        if tbf.returncode:
            raise RuntimeError(f"tc tbf on the store: {tbf.stderr.strip()}")
        relay = self._run(self.node, "delay", [str(ROOT / "tests/harness/delaylink.py"),
                                               self.store.addr, self.node.addr,
                                               str(DELAY_MS)])
        relay.wait_for("ready", 60)
        return (f"tbf rate {RATE} on the store's interface; no netem (nor fq) in this "
                f"kernel: {DELAY_MS} ms added to each round trip by a relay of the node's "
                "packets to the store (tests/harness/delaylink.py)")

    def _run(self, host: netns.Host, label: str, args: list[str]) -> Process:
        return self.run(host, label, [sys.executable, *args],
                        worker_env(s3server.s3_env(self.endpoint) if self.endpoint else {}))

    def on_node(self, args: list[str], timeout: float) -> dict:
        """Run ``python ARGS`` on the node; its last ``RESULT {json}`` line."""
        p = self._run(self.node, f"reader{len(self.procs)}", args)
        found = p.wait_for(r"RESULT (\{.*\})", timeout)
        return json.loads(found[1])


def serve(home: Path, addr: str, files: int, mib: int) -> None:
    """The store host's process: the server on ``addr``, the objects put (whole, so each
    ETag is the MD5 the cache checks), ``ready ENDPOINT``; then serve until stopped."""
    import numpy as np
    with s3server.s3_server(home, ip=addr) as server:
        client, rng = server.client(), np.random.default_rng(0)
        for k in range(files):
            body = rng.integers(0, 50000, mib << 19, dtype=np.uint16).tobytes()
            client.put_object(Bucket=s3server.BUCKET, Key=f"{TOKENS}/part-{k:03d}.bin",
                              Body=body)
        print(f"ready {server.endpoint}", flush=True)
        while True:
            signal.pause()


if __name__ == "__main__":
    if sys.argv[1:2] != ["store"] or len(sys.argv) != 6:
        raise SystemExit("usage: python -m bench.linkrig store HOME ADDR FILES MIB")
    serve(Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
