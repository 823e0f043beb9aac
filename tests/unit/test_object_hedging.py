"""A range of an object that lags far behind the others is asked for again
(train/data/hedging.py): the rule on its own, then against a real S3 server (SeaweedFS
on 127.0.0.1) behind a relay that holds up one chosen range's answer part-way
(tests/harness/lagproxy.py): the range is asked a second time with the same If-Match,
the copy is the object byte for byte whichever answer wins, and the request that lost
ends and closes its connection without writing. Nothing here measures a duration: the
relay holds an answer until the test lets it go. Skips without boto3 and weed."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from tests.harness.lagproxy import LagProxy
from tests.harness.runs import limit
from tests.unit.test_object_ranges import PART, objects
from train.core.storage import s3
from train.data import hedging, objectget
from train.data.hedging import HEDGE_AFTER, HEDGE_FLOOR_S, Range, due
from train.data.shardcache import ShardCache


def finished(r: Range, took: float) -> Range:
    r.took = took
    r.done.set_result(r.end - r.start)
    return r


def test_no_range_is_asked_again_before_half_of_them_arrived():
    ranges = [Range(k, k + 1) for k in range(8)]
    for r in ranges[:3]:
        finished(r, 0.1)
    for r in ranges[3:]:
        r.began = 0.0
    assert due(ranges, now=1e6) == ([], None)  # woken by the next range's end instead


def test_a_range_past_twice_the_median_of_the_others_is_asked_again_once():
    ranges = [finished(Range(k, k + 1), took) for k, took in
              enumerate([0.3, 0.3, 0.3, 0.2, 0.4, 0.3, 5.0])]  # one slow: not the median
    late = Range(7, 8)
    late.began = 10.0
    ranges.append(late)
    limit_s = HEDGE_AFTER * 0.3
    assert due(ranges, now=10.0 + limit_s / 2) == ([], pytest.approx(limit_s / 2))
    assert due(ranges, now=10.0 + limit_s + 0.01) == ([late], None)
    late.hedged = True
    assert due(ranges, now=10.0 + 100) == ([], None)


def test_ranges_of_milliseconds_wait_for_the_floor_and_one_not_sent_is_looked_at_again():
    ranges = [finished(Range(k, k + 1), 0.001) for k in range(6)]
    sent, queued = Range(6, 7), Range(7, 8)
    sent.began = 0.0
    ranges += [sent, queued]
    assert due(ranges, now=HEDGE_FLOOR_S / 2) == ([], pytest.approx(HEDGE_FLOOR_S / 2))
    assert due(ranges, now=HEDGE_FLOOR_S + 0.01) == ([sent], HEDGE_FLOOR_S)


def test_the_first_whole_answer_wins_and_the_other_may_not_write():
    r = Range(0, 4)
    r.outstanding = 2
    first, hedge, landed = object(), object(), []
    failed = OSError("cut off")
    r.end_of(first, 0, failed, 0.9)  # the hedge may still bring it
    assert not r.done.done()
    r.end_of(hedge, 4, None, 0.1, land=lambda: landed.append("hedge"))
    assert r.done.result() == 4 and landed == ["hedge"] and r.took == 0.1
    with r.lock:
        assert r.writable(hedge) and not r.writable(first)
    r.close()
    with r.lock:
        assert not r.writable(hedge)
    alone = Range(0, 4)
    alone.outstanding = 1
    alone.end_of(first, 0, failed, 0.9)  # no other request: the range fails
    assert alone.done.exception() is failed


def test_the_data_client_has_a_connection_for_every_range_and_hedge_at_once():
    assert objectget.CONNECTIONS > objectget.IN_FLIGHT + hedging.HEDGES
    assert s3.DATA_CONNECTIONS >= objectget.CONNECTIONS


def eventually(what: str, holds) -> None:
    deadline = time.monotonic() + limit(60)
    while not holds():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def no_hedge_running() -> bool:
    return not any(t.name == "data-fetch-hedge" for t in threading.enumerate())


@pytest.fixture
def lagging(aws, tmp_path, monkeypatch):
    """An object of 8 ranges (one PUT: its ETag is its MD5), and a relay in front of the
    server that holds the answers for its fourth range (``start(lags)``: how many of
    them) after 20 KiB, the cache reading through it in chunks of 16 KiB."""
    monkeypatch.setattr(objectget, "PART", PART)
    monkeypatch.setattr(objectget, "MIN_PART", PART)
    monkeypatch.setattr(objectget, "READ", 16 << 10)
    paths, (f,) = objects(aws, tmp_path, f"lag-{tmp_path.name}", sizes=(8 * PART,),
                          multipart=False)
    assert objectget.PLAIN_MD5.match(f.etag) and len(objectget.parts(f.size)) == 8
    start, end = objectget.parts(f.size)[3]
    wanted = f"range: bytes={start}-{end - 1}"
    proxies = []

    def start_proxy(lags: int) -> tuple[LagProxy, ShardCache]:
        proxy = LagProxy(int(aws.endpoint.rpartition(":")[2]), lags=lags,
                         hold_body=20 << 10, chosen=lambda head: wanted in head.lower())
        proxies.append(proxy)
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
        hedge = objectget._hedge

        def once_the_first_is_held(*args):
            # on a loaded machine the first request can leave later than its hedge: the
            # hedge goes once the first one's answer is held, so the first is chosen 0
            assert proxy.held[0].wait(limit(60))
            return hedge(*args)
        monkeypatch.setattr(objectget, "_hedge", once_the_first_is_held)
        return proxy, ShardCache(tmp_path / "cache", 1 << 30)
    yield start_proxy, f, paths[0].read_bytes(), wanted
    for p in proxies:
        p.close()


def asked_for(proxy: LagProxy, wanted: str, etag: str) -> int:
    heads = [h.lower() for h in proxy.heads if wanted in h.lower()]
    assert all(f'if-match: "{etag}"' in h for h in heads)
    return len(heads)


def test_a_range_held_up_is_asked_again_and_the_hedge_lands(lagging, caplog):
    start_proxy, f, data, wanted = lagging
    proxy, cache = start_proxy(lags=1)
    with caplog.at_level(logging.INFO, logger="train"):
        got = cache.local(f).read_bytes()
    assert proxy.held[0].wait(limit(60))  # the first answer stays held part-way
    assert asked_for(proxy, wanted, f.etag) == 2
    assert got == data
    assert any("asked again" in r.getMessage() for r in caplog.records)
    proxy.release(0)  # the first answer goes on: its request ends, writing nothing
    assert proxy.closed[0].wait(limit(60))  # and closes its connection
    eventually("the hedge's slot is given back", no_hedge_running)
    assert cache.path(f).read_bytes() == data
    assert [p.name for p in cache.folder.iterdir() if not p.name.startswith(".")] == \
        [cache.path(f).name]
    assert not [p for p in cache.folder.iterdir() if p.name.endswith(".part")]


def test_when_the_first_answer_wins_the_hedge_is_abandoned(lagging):
    start_proxy, f, data, wanted = lagging
    proxy, cache = start_proxy(lags=2)
    result: list = []
    fetch = threading.Thread(target=lambda: result.append(cache.local(f).read_bytes()))
    fetch.start()
    assert proxy.held[0].wait(limit(60)) and proxy.held[1].wait(limit(60))  # both held
    proxy.release(0)  # the first request's answer arrives whole before the hedge's
    fetch.join(limit(60))
    assert result == [data]
    assert asked_for(proxy, wanted, f.etag) == 2
    proxy.release(1)
    assert proxy.closed[1].wait(limit(60))
    eventually("the hedge ends", no_hedge_running)
    assert cache.path(f).read_bytes() == data
    slots = objectget._threads().hedges  # every slot given back
    taken = [slots.acquire(blocking=False) for _ in range(hedging.HEDGES)]
    for _ in range(sum(taken)):
        slots.release()
    assert all(taken)
