"""Bounded queues between pipeline stages, with named drop policies.

``keep_newest`` (live cameras): a full queue drops its oldest item, so inference always sees the
freshest frame and latency stays bounded. ``process_all`` (files): a full queue makes the producer
wait, so every frame is processed; it is woken once its queue has drained to half (see
:meth:`SlotInbox.take`). Several streams feeding one slot each get their own queue; ``take`` gathers
a batch across them round-robin so no stream starves another.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

T = TypeVar("T")
DropPolicy = Literal["keep_newest", "process_all"]


@dataclass
class _Lane(Generic[T]):
    capacity: int
    policy: DropPolicy
    items: deque[T]
    dropped: int = 0


class StageQueue:
    """A queue between two pipeline stages that the producers close when they are done."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._closed = False

    def _empty(self) -> bool:
        """Nothing left to take (called with the condition held)."""
        raise NotImplementedError

    def close(self) -> None:
        """No more puts; ``drained`` becomes True once the last item is taken."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def drained(self) -> bool:
        with self._cond:
            return self._closed and self._empty()


class SlotInbox(StageQueue, Generic[T]):
    """Per-stream bounded lanes behind one condition variable."""

    def __init__(self, on_drop: Callable[[str, T], None] | None = None) -> None:
        super().__init__()
        self._lanes: dict[str, _Lane[T]] = {}
        self._order: list[str] = []
        self._next = 0
        self._on_drop = on_drop
        # Items in all lanes, and producers waiting on a full process_all lane: kept so that the
        # per-frame calls neither walk the lanes to learn whether any holds an item nor wake
        # producers that are not waiting.
        self._count = 0
        self._producers_waiting = 0

    def add_lane(self, stream: str, capacity: int, policy: DropPolicy) -> None:
        with self._cond:
            self._lanes[stream] = _Lane(capacity=capacity, policy=policy, items=deque())
            self._order.append(stream)

    def put(self, stream: str, item: T, timeout: float) -> bool:
        """Queue ``item``. False when a ``process_all`` lane stayed full for ``timeout`` (caller retries)."""
        dropped: T | None = None
        with self._cond:
            lane = self._lanes[stream]
            if len(lane.items) >= lane.capacity:
                if lane.policy == "keep_newest":
                    dropped = lane.items.popleft()
                    lane.dropped += 1
                    self._count -= 1
                else:
                    deadline = time.monotonic() + timeout
                    while len(lane.items) >= lane.capacity:
                        remaining = deadline - time.monotonic()
                        if remaining <= 0 or self._closed:
                            return False
                        self._producers_waiting += 1
                        try:
                            self._cond.wait(remaining)
                        finally:
                            self._producers_waiting -= 1
            lane.items.append(item)
            self._count += 1
            self._cond.notify_all()
        if dropped is not None and self._on_drop is not None:
            self._on_drop(stream, dropped)
        return True

    def take(self, max_items: int, timeout: float) -> list[T]:
        """Up to ``max_items`` items, round-robin over lanes; waits up to ``timeout`` for the first.

        A producer waiting on a full ``process_all`` lane is woken once that lane is down to half its
        capacity, not at the first free place: it then decodes several frames in one go instead of
        one per wake-up. On two cores busy with inference each wake-up preempts an inference thread
        and runs on cold caches (docs/benchmarks.md, "Frame path").
        """
        with self._cond:
            if not self._count:
                self._cond.wait_for(self._any_or_closed, timeout)
            batch: list[T] = []
            refill = False
            while len(batch) < max_items and self._count:
                name = self._order[self._next % len(self._order)]
                self._next += 1
                lane = self._lanes[name]
                if lane.items:
                    batch.append(lane.items.popleft())
                    self._count -= 1
                    refill = refill or len(lane.items) <= lane.capacity // 2
            if refill and self._producers_waiting:
                self._cond.notify_all()  # wake producers waiting on a full process_all lane
            return batch

    def _any(self) -> bool:
        return self._count > 0

    def _any_or_closed(self) -> bool:
        return self._closed or self._any()

    def _empty(self) -> bool:
        return not self._any()

    def depths(self) -> dict[str, int]:
        with self._cond:
            return {name: len(lane.items) for name, lane in self._lanes.items()}
