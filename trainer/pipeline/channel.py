"""Bounded channels between pipeline threads.

A `Channel` is a FIFO of at most `capacity` items. `put` blocks while the channel is full (back-pressure:
a fast target worker waits instead of filling host or GPU memory), `get` blocks while it is empty. Every
blocking call has a timeout and wakes at least every `POLL_S` seconds to look at the run's stop event, so no
thread can sleep forever on a peer that died.

Two ways to end a channel:
- `close()`: end of stream. Items already queued can still be taken; once empty, `get` raises
  `ChannelClosed`, and `put` raises at once.
- `abort(reason)`: the run failed. Queued items are dropped and every waiter on either side raises
  `ChannelAborted(reason)` immediately. The supervisor aborts every channel when any worker fails, so the
  failure of one thread wakes all the others within one poll interval.

Depth metrics (`stats()`) tell which side starves: time producers spent blocked on a full channel means the
consumer is the bottleneck; time consumers spent blocked on an empty channel means the producer is.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

# Upper bound on how long a blocked call sleeps before re-checking the stop event. A notify wakes it sooner;
# this only bounds the latency of noticing an external stop (0.1 s of latency, negligible CPU).
POLL_S = 0.1


class ChannelError(RuntimeError):
    """Base class of everything a channel raises."""


class ChannelClosed(ChannelError):
    """The channel was closed (end of stream) and holds nothing more."""


class ChannelAborted(ChannelError):
    """The run failed or was stopped; the reason names the cause."""


class ChannelTimeout(ChannelError, TimeoutError):
    """A put/get waited longer than its timeout: the peer is stalled."""


@dataclass
class ChannelStats:
    name: str
    depth: int
    capacity: int
    max_depth: int
    puts: int
    gets: int
    put_blocked_s: float  # producers waiting on a full channel: the consumer is slower
    get_blocked_s: float  # consumers waiting on an empty channel: the producer is slower


class Channel(Generic[T]):
    """A bounded, closeable, abortable FIFO shared by threads. Thread-safe."""

    def __init__(self, name: str, capacity: int, stop_event: threading.Event | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"channel {name}: capacity must be >= 1, got {capacity}")
        self.name = name
        self.capacity = capacity
        self._stop_event = stop_event if stop_event is not None else threading.Event()
        self._items: collections.deque[T] = collections.deque()
        self._cond = threading.Condition(threading.Lock())
        self._closed = False
        self._abort_reason: str | None = None
        self._max_depth = 0
        self._puts = 0
        self._gets = 0
        self._put_blocked_s = 0.0
        self._get_blocked_s = 0.0

    # -- state checks, called with the lock held -------------------------------------------------------
    def _raise_if_aborted(self) -> None:
        if self._abort_reason is not None:
            raise ChannelAborted(f"channel {self.name} aborted: {self._abort_reason}")
        if self._stop_event.is_set():
            raise ChannelAborted(f"channel {self.name}: run is stopping")

    def _wait(self, deadline: float, what: str, timeout: float) -> float:
        """Sleep until notified, the poll interval passes or the deadline; return seconds slept."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ChannelTimeout(f"channel {self.name}: {what} timed out after {timeout:.1f} s")
        started = time.monotonic()
        self._cond.wait(min(remaining, POLL_S))
        return time.monotonic() - started

    # -- public API -----------------------------------------------------------------------------------
    def put(self, item: T, timeout: float) -> None:
        """Append `item`, blocking while full. Raises ChannelAborted/ChannelClosed/ChannelTimeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                self._raise_if_aborted()
                if self._closed:
                    raise ChannelClosed(f"channel {self.name} is closed; cannot put")
                if len(self._items) < self.capacity:
                    break
                self._put_blocked_s += self._wait(deadline, "put (channel full)", timeout)
            self._items.append(item)
            self._puts += 1
            self._max_depth = max(self._max_depth, len(self._items))
            self._cond.notify_all()

    def get(self, timeout: float) -> T:
        """Take the oldest item, blocking while empty. Raises ChannelAborted/ChannelClosed/ChannelTimeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                self._raise_if_aborted()
                if self._items:
                    break
                if self._closed:
                    raise ChannelClosed(f"channel {self.name} is closed and empty")
                self._get_blocked_s += self._wait(deadline, "get (channel empty)", timeout)
            item = self._items.popleft()
            self._gets += 1
            self._cond.notify_all()
            return item

    def close(self) -> None:
        """End of stream: queued items stay available to `get`; further `put`s fail."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def abort(self, reason: str) -> None:
        """Fail every current and future put/get with `reason`; drop queued items (frees their memory)."""
        with self._cond:
            if self._abort_reason is None:
                self._abort_reason = reason
            self._items.clear()
            self._cond.notify_all()

    def wake(self) -> None:
        """Wake every waiter so it re-checks the stop event now instead of within POLL_S."""
        with self._cond:
            self._cond.notify_all()

    def depth(self) -> int:
        with self._cond:
            return len(self._items)

    def stats(self) -> ChannelStats:
        with self._cond:
            return ChannelStats(
                name=self.name,
                depth=len(self._items),
                capacity=self.capacity,
                max_depth=self._max_depth,
                puts=self._puts,
                gets=self._gets,
                put_blocked_s=round(self._put_blocked_s, 4),
                get_blocked_s=round(self._get_blocked_s, 4),
            )


class ChannelGroup:
    """Every channel of one run, so a failure anywhere can abort them all at once."""

    def __init__(self, stop_event: threading.Event) -> None:
        self.stop_event = stop_event
        self._channels: dict[str, Channel] = {}

    def new(self, name: str, capacity: int) -> Channel:
        if name in self._channels:
            raise ValueError(f"duplicate channel name {name}")
        channel: Channel = Channel(name, capacity, self.stop_event)
        self._channels[name] = channel
        return channel

    def __getitem__(self, name: str) -> Channel:
        return self._channels[name]

    def __iter__(self):
        return iter(self._channels.values())

    def abort_all(self, reason: str) -> None:
        for channel in self._channels.values():
            channel.abort(reason)

    def wake_all(self) -> None:
        for channel in self._channels.values():
            channel.wake()

    def stats(self) -> list[ChannelStats]:
        return [channel.stats() for channel in self._channels.values()]
