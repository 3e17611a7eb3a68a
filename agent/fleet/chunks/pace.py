"""What the chunk server tells a device about its line: the rate it serves at and the notices. Pure.

A device asks for chunks and waits ``timeout_ms`` before asking again. When a wave starts, hundreds of
devices ask at once and a device at the back of the line waits far longer than that: without a word
from the server it asks again and again (the repeats merge into what waits, but each costs a message
through the broker and a request to check, and the device cannot tell a slow line from a lost reply).
So the server tells it: a *wait notice* names how long its chunks should take to leave (the chunks
ahead of them over the rate the broker acknowledges chunks at), and the device waits that long before
asking again. A request that finds no room in the line gets a *busy notice* with when to come back.

Why the server's word and not a window the device adapts (as TCP's congestion window): the line is
the server's and it is shared; a device learns a window only from its losses, i.e. from the very
timeouts to avoid, and a smaller window does not shorten a line all devices wait in.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

from agent.protocol.chunks import MAX_NOTICE_MS, ChunkNotice

#: The rate is measured over the acknowledgements of this much recent time.
RATE_WINDOW_S = 10.0
#: Shortest span of samples that gives a rate (the first chunks of a wave leave in a burst).
_MIN_SPAN_S = 0.5
#: A pause this long between samples starts a new busy period (the previous rate is kept till then).
_IDLE_S = 1.0
#: Samples closer together than this are skipped (bounds the samples kept).
_SAMPLE_EVERY_S = 0.05
#: A wait shorter than this share of the device's timeout needs no notice: the device waits anyway.
_NOTICE_SHARE = 0.5
#: A busy server's retry delay, when it has no rate measured, and its bounds.
_BUSY_RETRY_S = 5.0
_BUSY_MIN_S = 1.0
_BUSY_MAX_S = 60.0


@dataclass
class ServeRate:
    """Chunks per second the broker acknowledged lately, from samples of the acknowledged count."""

    _samples: collections.deque[tuple[float, int]] = field(default_factory=collections.deque)
    _previous: float | None = None

    def sample(self, now: float, acked: int) -> None:
        """Record that ``acked`` chunk publishes were acknowledged so far, at monotonic time ``now``."""
        samples = self._samples
        if samples and now - samples[-1][0] >= _IDLE_S:
            self._previous = self.per_second
            samples.clear()
        if samples and now - samples[-1][0] < _SAMPLE_EVERY_S:
            return
        samples.append((now, acked))
        while len(samples) > 2 and now - samples[0][0] > RATE_WINDOW_S:
            samples.popleft()

    @property
    def per_second(self) -> float | None:
        """The rate of this busy period, else of the last one; None before any was measured."""
        if len(self._samples) >= 2:
            (t0, n0), (t1, n1) = self._samples[0], self._samples[-1]
            if t1 - t0 >= _MIN_SPAN_S and n1 > n0:
                return (n1 - n0) / (t1 - t0)
        return self._previous


def wait_notice(*, ahead: int, own: int, per_second: float | None, timeout_ms: int) -> ChunkNotice | None:
    """The notice for a request whose ``own`` chunks wait behind ``ahead`` others, or None.

    None when no rate is known yet, or when the wait is well within the device's ``timeout_ms``.
    """
    if per_second is None or per_second <= 0:
        return None
    wait_ms = math.ceil((ahead + own) / per_second * 1000)
    if wait_ms < timeout_ms * _NOTICE_SHARE:
        return None
    return ChunkNotice(wait_ms=min(wait_ms, MAX_NOTICE_MS), ahead=ahead)


def busy_notice(*, waiting: int, per_second: float | None) -> ChunkNotice:
    """The notice for a request the full line refused: come back when ``waiting`` chunks are sent."""
    retry_s = waiting / per_second if per_second else _BUSY_RETRY_S
    return ChunkNotice(retry_ms=math.ceil(min(max(retry_s, _BUSY_MIN_S), _BUSY_MAX_S) * 1000))
