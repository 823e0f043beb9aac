"""What a node's launcher says and does about rendezvous rounds, in process: one log line
per round (who left and joined, long waits), a node left out of a newer round stops its
stale workers once, silence that includes this node is no lost node, a store not up yet
is not a lost one, the timings are
config keys. Simulated nodes running for real (tests/harness/multinode.py):
tests/e2e/test_multinode_runs.py."""

from __future__ import annotations

import datetime
import json
import time

from launcher.detection.system import free_port
from launcher.liveness.rdzv_state import Round, describe
from launcher.liveness.rounds import RoundWatcher

# --------------------------------------------------------------- one line a round

def _round(number: int, complete: bool, members: dict[str, int], **kw) -> Round:
    return Round(number=number, complete=complete, closed=False, deadline=kw.get("deadline"),
                 members=members, waiting=kw.get("waiting", ()), silent=kw.get("silent", {}))


def test_a_node_logs_each_round_who_left_and_joined_and_long_waits():
    lines: list[str] = []
    w = RoundWatcher("127.0.0.1:1", "job", (2, 3), 600, lines.append, still_every_s=15)
    w.observe(_round(0, True, {"a:1": 0, "b:1": 1}), now=0)
    w.observe(_round(0, True, {"a:1": 0, "b:1": 1}, silent={"b:1": 6.0}), now=1)
    w.observe(_round(1, False, {"a:1": 0}), now=2)
    w.observe(_round(1, False, {"a:1": 0}), now=10)  # nothing new yet: no line
    w.observe(_round(1, False, {"a:1": 0}), now=18)  # still waiting after 16 s
    w.observe(_round(1, True, {"a:1": 0, "c:1": 1}), now=20)
    assert lines[0] == "rendezvous round 0 complete: 2 node(s) [a:1 rank 0, b:1 rank 1]"
    assert lines[1] == ("rendezvous round 0 complete: 2 node(s) [a:1 rank 0, b:1 rank 1 "
                        "(silent 6 s)]")
    assert lines[2] == "rendezvous round 1 forming: 1 node(s) [a:1]"
    assert lines[3].startswith("rendezvous: still waiting in round 1: 1 node(s) joined, at "
                               "least 2 needed, for 16 s")
    assert lines[4] == ("rendezvous round 1 complete: 2 node(s) [a:1 rank 0, c:1 rank 1]; "
                        "joined: c:1; left: b:1")
    assert len(lines) == 5


def test_a_node_left_out_of_a_newer_round_stops_its_stale_workers_once():
    """Cut off and healed: the others met without this node ("c:7#42"); its workers are
    in a world that no longer exists. A node that only waits to join is not told so."""
    left_out: list[int] = []
    w = RoundWatcher("127.0.0.1:1", "job", (1, 3), 600, lambda line: None, me=":7#42",
                     on_left_out=left_out.append)
    w.observe(_round(0, True, {"a:1#5": 0, "c:7#42": 1}), now=0)
    w.observe(_round(1, True, {"a:1#5": 0, "c:7#42": 1}), now=1)  # still a member
    assert left_out == []
    w.observe(_round(3, True, {"a:1#5": 0}), now=2)  # rounds went on without it
    w.observe(_round(3, True, {"a:1#5": 0}), now=3)
    w.observe(_round(4, False, {"a:1#5": 0, "c:7#42": 0}), now=4)
    w.observe(_round(4, True, {"a:1#5": 0, "c:7#42": 1}), now=5)
    assert left_out == [3]
    joiner: list[int] = []
    new = RoundWatcher("127.0.0.1:1", "job", (1, 3), 600, lambda line: None, me=":9#43",
                       on_left_out=joiner.append)
    new.observe(_round(5, True, {"a:1#5": 0, "c:7#42": 1}), now=0)
    new.observe(_round(6, True, {"a:1#5": 0}), now=1)
    assert joiner == []


def test_silence_that_includes_this_node_is_no_lost_node():
    """Every member's keep-alive late, this node's too (a store that was slow to answer,
    a loaded machine): nobody vanished. A member dropped from the round still is lost."""
    lost: list[list[str]] = []
    w = RoundWatcher("127.0.0.1:1", "job", (1, 3), 600, lambda line: None, lost_after_s=10,
                     on_lost=lambda nodes, why: lost.append(nodes), me=":7#42")
    w.observe(_round(0, True, {"a:1#5": 0, "c:7#42": 1}), now=0)
    w.observe(_round(0, True, {"a:1#5": 0, "c:7#42": 1},
                     silent={"a:1#5": 13.0, "c:7#42": 13.0}), now=1)
    assert lost == []
    w.observe(_round(0, True, {"c:7#42": 1}, silent={"c:7#42": 13.0}), now=2)
    assert lost == [["a:1#5"]]
    alone: list[list[str]] = []
    other = RoundWatcher("127.0.0.1:1", "job", (1, 3), 600, lambda line: None,
                         lost_after_s=10, on_lost=lambda nodes, why: alone.append(nodes),
                         me=":7#42")
    other.observe(_round(0, True, {"a:1#5": 0, "c:7#42": 1}), now=0)
    other.observe(_round(0, True, {"a:1#5": 0, "c:7#42": 1}, silent={"a:1#5": 11.0}), now=1)
    assert alone == [["a:1#5"]]


def _until(cond, within_s: float = 30.0) -> bool:
    deadline = time.monotonic() + within_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def test_a_store_not_up_yet_is_not_a_lost_store_but_one_that_answered_and_went_is():
    """The store's node may start its torchrun long after this one (a busy machine):
    until the store first answers, it has not been unreachable for any time. Once it
    answered and went away, the time counts."""
    import torch.distributed as dist
    port = free_port()  # refused until the store listens there
    w = RoundWatcher(f"127.0.0.1:{port}", "job", (2, 2), 600, lambda line: None, poll_s=0.01)
    w.start()
    try:
        time.sleep(0.3)  # many polls, every one refused
        assert w.unreachable_for() == 0.0 and not w.answered_once
        store = dist.TCPStore("127.0.0.1", port, is_master=True,
                              timeout=datetime.timedelta(seconds=10))
        assert _until(lambda: w.store is not None)
        del store  # the store's process ends
        assert _until(lambda: w.unreachable_for() > 0.1)
    finally:
        w.stop.set()
        w.join(10)


def test_a_forming_round_says_until_when_and_shows_no_ranks():
    deadline = datetime.datetime(2026, 1, 1, 12, 0, 3, tzinfo=datetime.UTC)
    text = describe(_round(4, False, {"b:2#9": 0, "b:2#7": 0}, deadline=deadline))
    assert text.startswith("round 4 forming: 2 node(s) [b:2#7, b:2#9]; last call until ")
    assert "rank" not in text.split(";")[0]
    assert "b:2 stand(s) for several nodes" in text


def test_rendezvous_timings_are_config_keys(tmp_path):
    import yaml

    from launcher.detection.hardware import Hardware, TorchBuild
    from launcher.planning import environ
    from launcher.planning.plan import plan
    from train.core.config import load_config
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"kind": "mlp"}, "data": {"kind": "synthetic"},
                                    "output": {"dir": str(tmp_path)}}))
    cfg = load_config(path, ["distributed.rdzv_last_call_s=1", "distributed.rdzv_keep_alive_s=5",
                             "distributed.rdzv_join_timeout_s=60"])
    env = environ.read({"JOB_COMPLETION_INDEX": "0", "TRAIN_RDZV_ENDPOINT": "s:1",
                        "TRAIN_NNODES": "1:2", "TRAIN_RDZV_ID": "u"})
    p = plan(cfg, Hardware(cpus=4), TorchBuild(version="x", gloo=True), env,
             config_path=str(path), overrides=[], python="py", app_root="/app")
    conf = p.argv[p.argv.index("--rdzv-conf") + 1]
    assert conf == ("is_host=false,join_timeout=60,last_call_timeout=1,keep_alive_interval=5,"
                    "keep_alive_max_attempt=4")
    assert p.store == "s:1" and p.job == "u" and p.join_timeout_s == 60
    assert json.loads(json.dumps(p.to_dict()))["store_wait_s"] == 300
