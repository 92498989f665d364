"""Channel: bounded FIFO with back-pressure, close (end of stream), abort (failure), timeouts, stop event."""

from __future__ import annotations

import threading
import time

import pytest

from trainer.pipeline.channel import (
    Channel,
    ChannelAborted,
    ChannelClosed,
    ChannelGroup,
    ChannelTimeout,
)

pytestmark = pytest.mark.timeout(20)


def test_fifo_and_depth_metrics() -> None:
    channel: Channel[int] = Channel("c", capacity=3)
    for i in range(3):
        channel.put(i, timeout=1)
    assert channel.depth() == 3
    assert [channel.get(timeout=1) for _ in range(3)] == [0, 1, 2]
    stats = channel.stats()
    assert (stats.puts, stats.gets, stats.max_depth, stats.depth) == (3, 3, 3, 0)


def test_full_channel_applies_back_pressure_then_times_out() -> None:
    channel: Channel[int] = Channel("c", capacity=1)
    channel.put(1, timeout=1)
    started = time.monotonic()
    with pytest.raises(ChannelTimeout, match="put .channel full. timed out"):
        channel.put(2, timeout=0.3)
    assert 0.25 < time.monotonic() - started < 2
    assert channel.stats().put_blocked_s > 0.2
    assert channel.depth() == 1  # the rejected item was not added


def test_blocked_put_proceeds_when_consumer_takes() -> None:
    channel: Channel[int] = Channel("c", capacity=1)
    channel.put(1, timeout=1)
    taker = threading.Timer(0.2, lambda: channel.get(timeout=1))
    taker.start()
    channel.put(2, timeout=5)  # unblocked by the taker
    taker.join()
    assert channel.get(timeout=1) == 2


def test_empty_get_times_out() -> None:
    channel: Channel[int] = Channel("c", capacity=2)
    with pytest.raises(ChannelTimeout, match="get .channel empty."):
        channel.get(timeout=0.2)
    assert channel.stats().get_blocked_s > 0.15


def test_close_drains_then_ends_stream() -> None:
    channel: Channel[str] = Channel("c", capacity=2)
    channel.put("a", timeout=1)
    channel.close()
    with pytest.raises(ChannelClosed):
        channel.put("b", timeout=1)
    assert channel.get(timeout=1) == "a"
    with pytest.raises(ChannelClosed):
        channel.get(timeout=1)


def test_abort_wakes_blocked_waiters_on_both_sides_at_once() -> None:
    full: Channel[int] = Channel("full", capacity=1)
    empty: Channel[int] = Channel("empty", capacity=1)
    full.put(0, timeout=1)
    errors: list[BaseException] = []

    def wait(fn) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [
        threading.Thread(target=wait, args=(lambda: full.put(1, timeout=60),)),
        threading.Thread(target=wait, args=(lambda: empty.get(timeout=60),)),
    ]
    for t in threads:
        t.start()
    time.sleep(0.1)
    started = time.monotonic()
    for c in (full, empty):
        c.abort("worker target0 failed")
    for t in threads:
        t.join(2)
    assert time.monotonic() - started < 1.0
    assert len(errors) == 2 and all(isinstance(e, ChannelAborted) for e in errors)
    assert all("worker target0 failed" in str(e) for e in errors)
    assert full.depth() == 0  # queued items dropped so their memory is freed


def test_stop_event_ends_a_blocked_get_within_the_poll_interval() -> None:
    group = ChannelGroup(threading.Event())
    channel = group.new("c", 1)
    threading.Timer(0.1, group.stop_event.set).start()
    started = time.monotonic()
    with pytest.raises(ChannelAborted, match="stopping"):
        channel.get(timeout=60)
    assert time.monotonic() - started < 1.0


def test_bad_capacity_and_duplicate_names_are_rejected() -> None:
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        Channel("c", capacity=0)
    group = ChannelGroup(threading.Event())
    group.new("x", 1)
    with pytest.raises(ValueError, match="duplicate channel name"):
        group.new("x", 1)
