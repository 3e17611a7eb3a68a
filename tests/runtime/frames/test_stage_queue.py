"""SlotInbox: named drop policies, blocking puts, round-robin batches, close and drain."""

from __future__ import annotations

import threading

import pytest

from agent.runtime.frames.stage_queue import SlotInbox
from tests.waiting import patient


def test_keep_newest_drops_the_oldest_and_reports_it() -> None:
    dropped: list[tuple[str, int]] = []
    inbox: SlotInbox[int] = SlotInbox(on_drop=lambda stream, item: dropped.append((stream, item)))
    inbox.add_lane("cam", 2, "keep_newest")
    assert all(inbox.put("cam", i, timeout=0.0) for i in range(5))
    assert dropped == [("cam", 0), ("cam", 1), ("cam", 2)]
    assert inbox.depths() == {"cam": 2}
    assert inbox.take(10, timeout=0.0) == [3, 4]


def test_process_all_put_blocks_then_gives_up_after_its_timeout() -> None:
    dropped: list[int] = []
    inbox: SlotInbox[int] = SlotInbox(on_drop=lambda _s, item: dropped.append(item))
    inbox.add_lane("file", 1, "process_all")
    assert inbox.put("file", 1, timeout=0.0)
    assert inbox.put("file", 2, timeout=0.05) is False  # full: the caller must retry
    assert dropped == []
    assert inbox.take(10, timeout=0.0) == [1]  # nothing was replaced or lost


def test_process_all_put_resumes_when_the_consumer_takes() -> None:
    inbox: SlotInbox[int] = SlotInbox()
    inbox.add_lane("file", 1, "process_all")
    inbox.put("file", 1, timeout=0.0)
    result: list[bool] = []
    producer = threading.Thread(target=lambda: result.append(inbox.put("file", 2, timeout=10.0)))
    producer.start()
    assert inbox.take(1, timeout=1.0) == [1]
    producer.join(patient(10.0))
    assert result == [True]
    assert inbox.take(1, timeout=1.0) == [2]


def test_take_is_round_robin_across_lanes() -> None:
    inbox: SlotInbox[str] = SlotInbox()
    for lane in ("a", "b", "c"):
        inbox.add_lane(lane, 8, "process_all")
    for item in ("a1", "a2", "a3", "a4", "b1", "c1", "c2"):
        inbox.put(item[0], item, timeout=0.0)
    assert inbox.take(4, timeout=0.0) == ["a1", "b1", "c1", "a2"]
    # The next batch starts at the lane after the last one served, so 'a' cannot starve the others.
    assert inbox.take(4, timeout=0.0) == ["c2", "a3", "a4"]
    assert inbox.take(4, timeout=0.0) == []


def test_take_waits_for_the_first_item() -> None:
    inbox: SlotInbox[int] = SlotInbox()
    inbox.add_lane("cam", 4, "keep_newest")
    timer = threading.Timer(0.05, lambda: inbox.put("cam", 7, timeout=0.0))
    timer.start()
    try:
        assert inbox.take(4, timeout=10.0) == [7]
    finally:
        timer.cancel()


def drained(inbox: SlotInbox[int]) -> bool:
    """A call, so mypy does not narrow the property across ``close()`` and ``take()``."""
    return inbox.drained


def test_close_then_drain() -> None:
    inbox: SlotInbox[int] = SlotInbox()
    inbox.add_lane("file", 1, "process_all")
    inbox.put("file", 1, timeout=0.0)
    assert not drained(inbox)
    inbox.close()
    assert not drained(inbox)  # closed, but an item is still waiting
    assert inbox.put("file", 2, timeout=10.0) is False  # a blocked producer is released by close
    assert inbox.take(4, timeout=10.0) == [1]
    assert drained(inbox)
    assert inbox.take(4, timeout=10.0) == []  # returns at once: nothing can arrive any more


@pytest.mark.timeout(5)  # take() must return at close(), not after its own 10 s
def test_close_wakes_a_waiting_consumer() -> None:
    inbox: SlotInbox[int] = SlotInbox()
    inbox.add_lane("cam", 1, "keep_newest")
    timer = threading.Timer(0.05, inbox.close)
    timer.start()
    try:
        assert inbox.take(1, timeout=10.0) == []
        assert drained(inbox)
    finally:
        timer.cancel()


class CountingCondition(threading.Condition):
    """A condition that counts ``notify_all`` calls and tells when a thread starts waiting on it."""

    def __init__(self) -> None:
        super().__init__()
        self.notified = 0
        self.waiting = threading.Event()

    def notify_all(self) -> None:
        self.notified += 1
        super().notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.set()
        return super().wait(timeout)


def test_a_waiting_producer_is_woken_once_its_lane_is_down_to_half() -> None:
    inbox: SlotInbox[int] = SlotInbox()
    cond = CountingCondition()
    inbox._cond = cond  # the wake-ups are what is under test
    inbox.add_lane("file", 4, "process_all")
    for i in range(4):
        inbox.put("file", i, timeout=0.0)
    result: list[bool] = []
    producer = threading.Thread(target=lambda: result.append(inbox.put("file", 4, timeout=30.0)))
    producer.start()
    assert cond.waiting.wait(patient(10.0))
    notified = cond.notified
    assert inbox.take(1, timeout=0.0) == [0]  # 3 left: a place is free, the producer sleeps on
    assert cond.notified == notified
    assert result == []
    assert inbox.take(1, timeout=0.0) == [1]  # 2 left, half the lane: now it is woken
    assert cond.notified == notified + 1
    producer.join(patient(10.0))
    assert result == [True]
    assert inbox.take(10, timeout=0.0) == [2, 3, 4]
