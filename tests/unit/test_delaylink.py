"""The delay relay of tests/harness/delaylink.py (bench/linkrig.py's round-trip delay on
a kernel without netem): packets leave in the order they came, each once its delay has
passed, and the relay's wait is the time to the next one due."""

import pytest

from tests.harness.delaylink import Held


def test_packets_leave_in_order_once_due():
    held = Held(0.020)
    held.put(b"a", 1.000)
    held.put(b"b", 1.005)
    held.put(b"c", 1.030)
    assert held.due(1.019) == []
    assert held.wait(1.019) == pytest.approx(0.001)
    assert held.due(1.025) == [b"a", b"b"]
    assert held.wait(1.040) == pytest.approx(0.010)
    assert held.wait(1.060) == 0.0  # overdue: sent at once
    assert held.due(1.050) == [b"c"]
    assert held.wait(1.050) is None and held.due(2.0) == []
