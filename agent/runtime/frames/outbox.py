"""Between inference workers and the publisher: batches come out in the order they were taken.

Several inference workers finish batches in any order; a stream's results must still be published
in frame order. Each batch is numbered when a worker takes it from the inbox (under one lock, so
numbers follow the inbox's order) and handed in here under that number; the publisher gets items only
from the longest run of consecutive numbers that are in. A batch that produced nothing (inference
failed, no model) is still handed in, empty, or every later batch would wait for it forever.

Bounded: a worker waits while the outbox is full, and so applies back-pressure to the inbox (whose
drop policy then drops frames of a live camera as ``queue_full``, or slows a file source down). The
one exception is the next batch while nothing is ready to take: the publisher could not make progress
without it (a full outbox of later batches would deadlock the workers), so it always enters. The
bound is therefore ``capacity`` plus one batch: with one worker every batch is the next one, and a
publisher slowed by the spool's fsyncs must still hold the workers back.

``wake_at``: how many ready items wake the publisher. 1 (the default) publishes each result as soon
as it is in. Where no one waits on a single result (a slot fed by unpaced files only,
:mod:`agent.runtime.frames.layout`), a few at a time: on two cores busy with inference, each wake-up of the
publisher preempts an inference thread and runs on cold caches, and costs more than publishing the
result (docs/benchmarks.md, "Frame path"). A take that times out still
takes what is ready, close wakes it, and a full outbox wakes it whatever it holds, so ``wake_at``
delays a result by the publisher's poll interval at most.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Generic, TypeVar

from agent.runtime.frames.stage_queue import StageQueue

T = TypeVar("T")


class OrderedOutbox(StageQueue, Generic[T]):
    """Numbered batches in, items out in number order."""

    def __init__(self, capacity: int, wake_at: int = 1) -> None:
        super().__init__()
        self._capacity = capacity
        self._wake_at = max(1, wake_at)
        self._putters_waiting = 0  # workers waiting for room: woken by each put and take
        self._waiting: dict[int, list[T]] = {}  # batches that arrived before an earlier one
        self._ready: deque[T] = deque()
        self._next = 0  # number of the batch the publisher is waiting for
        self._size = 0  # items held, waiting or ready

    def put(self, number: int, items: list[T], timeout: float) -> bool:
        """Hand in batch ``number``. False when the outbox stayed full for ``timeout`` (caller retries)."""
        with self._cond:
            if self._must_wait(number):
                deadline = time.monotonic() + timeout
                while self._must_wait(number):
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    self._putters_waiting += 1
                    try:
                        self._cond.wait(remaining)
                    finally:
                        self._putters_waiting -= 1
            self._waiting[number] = items
            self._size += len(items)
            while self._next in self._waiting:
                self._ready.extend(self._waiting.pop(self._next))
                self._next += 1
            if self._putters_waiting or self._publishable():
                self._cond.notify_all()
            return True

    def _must_wait(self, number: int) -> bool:
        """Full, and the publisher has something to take without this batch (condition held)."""
        if self._size < self._capacity:
            return False
        return number != self._next or bool(self._ready)

    def _publishable(self) -> bool:
        """Enough is ready to wake the publisher for (condition held): ``wake_at`` items, or any once
        the outbox is full (workers may be waiting for the room they take up)."""
        ready = len(self._ready)
        return ready >= self._wake_at or (ready > 0 and self._size >= self._capacity)

    def take(self, max_items: int, timeout: float) -> list[T]:
        """Up to ``max_items`` items in order; waits up to ``timeout`` for ``wake_at`` of them (then
        takes what is ready, if any)."""
        with self._cond:
            if not self._publishable():
                self._cond.wait_for(lambda: self._publishable() or self._closed, timeout)
            out = [self._ready.popleft() for _ in range(min(max_items, len(self._ready)))]
            if out:
                self._size -= len(out)
                if self._putters_waiting:
                    self._cond.notify_all()  # wake workers waiting for room
            return out

    def _empty(self) -> bool:
        return not self._ready

    @property
    def depth(self) -> int:
        with self._cond:
            return self._size
