"""Between inference workers and the publisher: batches come out in the order they were taken.

Several inference workers finish batches in any order; a stream's results must still be published
in frame order. Each batch is numbered when a worker takes it from the inbox (under one lock, so
numbers follow the inbox's order) and handed in here under that number; the publisher gets items only
from the longest run of consecutive numbers that are in. A batch that produced nothing (inference
failed, no model) is still handed in, empty, or every later batch would wait for it forever.

Bounded: a worker whose batch is not the next one waits while the outbox is full; the next one never
waits, so the publisher can always make progress and the workers cannot deadlock each other.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Generic, TypeVar

from agent.runtime.stage_queue import StageQueue

T = TypeVar("T")


class OrderedOutbox(StageQueue, Generic[T]):
    """Numbered batches in, items out in number order."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self._capacity = capacity
        self._waiting: dict[int, list[T]] = {}  # batches that arrived before an earlier one
        self._ready: deque[T] = deque()
        self._next = 0  # number of the batch the publisher is waiting for
        self._size = 0  # items held, waiting or ready

    def put(self, number: int, items: list[T], timeout: float) -> bool:
        """Hand in batch ``number``. False when it is not next and the outbox stayed full for ``timeout``."""
        with self._cond:
            if number != self._next and self._size >= self._capacity:
                deadline = time.monotonic() + timeout
                while number != self._next and self._size >= self._capacity:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    self._cond.wait(remaining)
            self._waiting[number] = items
            self._size += len(items)
            while self._next in self._waiting:
                self._ready.extend(self._waiting.pop(self._next))
                self._next += 1
            self._cond.notify_all()
            return True

    def take(self, max_items: int, timeout: float) -> list[T]:
        """Up to ``max_items`` items in order; waits up to ``timeout`` for the first."""
        with self._cond:
            if not self._ready:
                self._cond.wait_for(lambda: bool(self._ready) or self._closed, timeout)
            out = [self._ready.popleft() for _ in range(min(max_items, len(self._ready)))]
            if out:
                self._size -= len(out)
                self._cond.notify_all()  # wake workers waiting for room
            return out

    def _empty(self) -> bool:
        return not self._ready

    @property
    def depth(self) -> int:
        with self._cond:
            return self._size
