"""The backpressure window on its own: reserve, wait, release, time out (real threads)."""

from __future__ import annotations

import threading
import time

import pytest

from shmrdv._errors import InvalidArgumentError, ResourceExhaustedError
from shmrdv._window import InflightWindow, check_window


def test_window_check_refuses_bad_limits() -> None:
    assert check_window(None) is None
    assert check_window(5) == 5
    for bad in (0, -1, 1.5, True, "8"):
        with pytest.raises(InvalidArgumentError, match="max_inflight_bytes"):
            check_window(bad)


def test_window_reserves_until_full_then_times_out_reserving_nothing() -> None:
    w = InflightWindow("/job:c/replica:0/task:0", 100)
    w.reserve(60, None)
    w.reserve(40, None)
    assert w.used == 100
    t0 = time.monotonic()
    with pytest.raises(ResourceExhaustedError, match=r"task:0.*max_inflight_bytes=100"):
        w.reserve(1, 0.1)
    assert 0.09 <= time.monotonic() - t0 < 2
    assert w.used == 100 and w.waits == 1


def test_window_waiter_proceeds_when_bytes_come_back() -> None:
    w = InflightWindow("c", 10)
    w.reserve(10, None)
    got: list[float] = []

    def sender() -> None:
        w.reserve(5, 5)
        got.append(time.monotonic())

    t = threading.Thread(target=sender)
    t.start()
    time.sleep(0.05)
    assert not got
    released = time.monotonic()
    w.release(6)
    t.join(5)
    assert got and got[0] >= released and w.used == 9


def test_window_refresh_is_asked_while_waiting() -> None:
    w = InflightWindow("c", 10)
    w.reserve(10, None)
    calls = 0

    def refresh() -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            w.release(10)

    w.reserve(10, 5, refresh)
    assert calls == 3 and w.used == 10


def test_window_tensor_larger_than_window_goes_when_nothing_in_flight() -> None:
    w = InflightWindow("c", 10)
    w.reserve(1000, 0)
    assert w.used == 1000
    with pytest.raises(ResourceExhaustedError):
        w.reserve(1, 0)
    w.reset()
    w.reserve(1, 0)
    assert w.used == 1


def test_window_charge_counts_without_waiting() -> None:
    w = InflightWindow("c", 10)
    w.reserve(10, None)
    w.charge(7)  # a value put back in flight: counted again, even over the limit
    assert w.used == 17
    w.release(17)
    assert w.used == 0


def test_windows_one_per_consumer_task_not_per_device() -> None:
    from shmrdv._keys import DeviceName
    from shmrdv._window import Windows

    ws = Windows(100)
    cpu = ws.of(DeviceName.parse("/job:w/task:1/device:CPU:0"))
    assert ws.of(DeviceName.parse("/job:w/replica:0/task:1/device:GPU:1")) is cpu
    assert cpu.consumer == "/job:w/replica:0/task:1"
    other = ws.of(DeviceName.parse("/job:w/replica:0/task:2"))
    assert other is not cpu
    cpu.reserve(30, None)
    other.reserve(100, None)
    with pytest.raises(ResourceExhaustedError, match="task:2"):
        other.reserve(1, 0)
    assert ws.used() == 130 and ws.waits() == 1
    ws.reset()
    assert ws.used() == 0


def test_windows_for_key_is_the_dst_tasks_window() -> None:
    from shmrdv._keys import DeviceName, create_key, parse_key
    from shmrdv._window import Windows

    ws = Windows(10)
    src = "/job:w/replica:0/task:0/device:CPU:0"
    a = ws.for_key(parse_key(create_key(src, 0, "/job:w/task:1/device:CPU:0", "a")))
    b = ws.for_key(parse_key(create_key(src, 0, "/job:w/replica:0/task:1/cpu:0", "b")))
    assert a is b is ws.of(DeviceName.parse("/job:w/replica:0/task:1"))
