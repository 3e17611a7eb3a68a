"""OrderedOutbox: numbered batches from several workers come out in number order, bounded."""

from __future__ import annotations

import random
import threading
import time

from agent.runtime.frames.outbox import OrderedOutbox
from tests.waiting import patient


def drain(box: OrderedOutbox[int]) -> list[int]:
    out: list[int] = []
    while items := box.take(100, timeout=0.0):
        out.extend(items)
    return out


def test_a_later_batch_waits_for_the_earlier_one() -> None:
    box: OrderedOutbox[int] = OrderedOutbox(capacity=16)
    assert box.put(1, [3, 4], timeout=0.1)
    assert drain(box) == []  # batch 0 is still being inferred
    assert box.put(0, [1, 2], timeout=0.1)
    assert drain(box) == [1, 2, 3, 4]


def test_an_empty_batch_releases_the_batches_after_it() -> None:
    box: OrderedOutbox[int] = OrderedOutbox(capacity=16)
    box.put(1, [7], timeout=0.1)
    box.put(0, [], timeout=0.1)  # inference failed: nothing to publish, but the number is used
    assert drain(box) == [7]


def test_a_full_outbox_makes_a_later_batch_wait_but_never_the_next_one() -> None:
    box: OrderedOutbox[int] = OrderedOutbox(capacity=2)
    assert box.put(1, [10, 11], timeout=0.1)  # fills it while batch 0 is out
    started = time.monotonic()
    assert not box.put(2, [12], timeout=0.2)  # not next and no room: refused after the timeout
    assert time.monotonic() - started >= 0.2
    assert box.put(0, [9], timeout=0.0)  # the next batch always gets in, or nothing could move
    assert box.depth == 3
    assert box.take(2, timeout=0.0) == [9, 10]
    assert box.put(2, [12], timeout=0.1)  # room again
    assert drain(box) == [11, 12]


def test_drained_only_after_close_and_the_last_item_taken() -> None:
    box: OrderedOutbox[int] = OrderedOutbox(capacity=4)
    box.put(0, [1], timeout=0.1)
    box.close()
    assert not box.drained
    assert box.take(10, timeout=0.0) == [1]
    assert box.drained


def test_take_waits_for_the_first_item_and_wakes_on_close() -> None:
    box: OrderedOutbox[int] = OrderedOutbox(capacity=4)
    threading.Timer(0.1, box.close).start()
    started = time.monotonic()
    assert box.take(10, timeout=60.0) == []
    # Woken by close, not by the timeout: far apart, so a loaded machine's late timer cannot blur them.
    assert time.monotonic() - started < 30.0


def test_workers_finishing_in_any_order_publish_in_take_order() -> None:
    box: OrderedOutbox[int] = OrderedOutbox(capacity=8)
    lock = threading.Lock()
    taken = {"next": 0}
    rng = random.Random(7)
    delays = [rng.random() * 0.002 for _ in range(300)]

    def worker() -> None:
        while True:
            with lock:  # what the pipeline does: number a batch as it is taken
                number = taken["next"]
                if number >= 300:
                    return
                taken["next"] += 1
            time.sleep(delays[number])  # "inference" of uneven length
            while not box.put(number, [number * 2, number * 2 + 1], timeout=0.05):
                pass

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    published: list[int] = []
    deadline = time.monotonic() + patient(30)
    while len(published) < 600 and time.monotonic() < deadline:
        published.extend(box.take(5, timeout=0.1))
        assert box.depth <= 8 + 2  # the bound, plus the next batch that may always enter
    for t in threads:
        t.join()
    assert published == list(range(600))


def test_with_one_worker_the_bound_holds_as_every_batch_is_the_next_one() -> None:
    # Issue 8: the next batch skipped the capacity check, and with one worker every batch is next,
    # so a slow publisher let the outbox grow without bound.
    box: OrderedOutbox[int] = OrderedOutbox(capacity=4)
    assert box.put(0, [1, 2, 3, 4], timeout=0.0)
    started = time.monotonic()
    assert not box.put(1, [5], timeout=0.1)  # the publisher has 4 items to take: the worker waits
    assert time.monotonic() - started >= 0.1
    assert box.depth == 4
    assert box.take(1, timeout=0.0) == [1]
    assert box.put(1, [5], timeout=0.0)
    assert drain(box) == [2, 3, 4, 5]


def test_the_next_batch_enters_a_full_outbox_when_nothing_is_ready() -> None:
    box: OrderedOutbox[int] = OrderedOutbox(capacity=2)
    assert box.put(1, [10, 11], timeout=0.0)  # full of a later batch; batch 0 is still out
    assert box.put(0, [9], timeout=0.0)  # refusing it would deadlock: the publisher needs it
    assert drain(box) == [9, 10, 11]


def test_a_slow_publisher_holds_one_fast_worker_within_the_bound() -> None:
    box: OrderedOutbox[int] = OrderedOutbox(capacity=8)
    done = threading.Event()

    def worker() -> None:
        for number in range(200):
            while not box.put(number, [number], timeout=0.05):
                pass
        done.set()

    t = threading.Thread(target=worker)
    t.start()
    published: list[int] = []
    while not (done.is_set() and box.depth == 0):
        assert box.depth <= 8 + 1  # the bound, plus one batch
        published.extend(box.take(1, timeout=0.05))
        time.sleep(0.0005)  # the publisher is slower than the worker
    t.join()
    assert published == list(range(200))


class CountingCondition(threading.Condition):
    """A condition that counts ``notify_all`` calls."""

    def __init__(self) -> None:
        super().__init__()
        self.notified = 0

    def notify_all(self) -> None:
        self.notified += 1
        super().notify_all()


def test_wake_at_wakes_the_publisher_once_that_many_results_are_ready() -> None:
    box: OrderedOutbox[int] = OrderedOutbox(capacity=16, wake_at=3)
    cond = CountingCondition()
    box._cond = cond  # the wake-ups are what is under test
    box.put(0, [1], timeout=0.0)
    box.put(1, [2], timeout=0.0)
    assert cond.notified == 0  # two ready: not worth a wake-up yet
    box.put(2, [3], timeout=0.0)
    assert cond.notified == 1
    assert box.take(10, timeout=0.0) == [1, 2, 3]


def test_wake_at_delays_a_result_by_the_take_timeout_at_most() -> None:
    box: OrderedOutbox[int] = OrderedOutbox(capacity=16, wake_at=4)
    box.put(0, [1, 2], timeout=0.0)
    assert box.take(10, timeout=0.0) == [1, 2]  # a take that times out takes what is ready
    box.put(1, [3], timeout=0.0)
    box.close()
    assert box.take(10, timeout=60.0) == [3]  # and close wakes it
    assert box.drained


def test_a_full_outbox_wakes_the_publisher_below_wake_at() -> None:
    # Workers may wait for the room the ready items take up: the publisher must not sleep on them.
    box: OrderedOutbox[int] = OrderedOutbox(capacity=2, wake_at=8)
    cond = CountingCondition()
    box._cond = cond
    box.put(0, [1], timeout=0.0)
    assert cond.notified == 0
    box.put(1, [2], timeout=0.0)
    assert cond.notified == 1
    assert box.take(10, timeout=0.0) == [1, 2]


def test_workers_and_a_publisher_woken_every_few_results_keep_take_order() -> None:
    box: OrderedOutbox[int] = OrderedOutbox(capacity=8, wake_at=4)
    lock = threading.Lock()
    taken = {"next": 0}

    def worker() -> None:
        while True:
            with lock:
                number = taken["next"]
                if number >= 301:  # not a multiple of wake_at: the last results come with close()
                    return
                taken["next"] += 1
            while not box.put(number, [number], timeout=0.05):
                pass

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()

    def close_after_workers() -> None:
        for t in threads:
            t.join()
        box.close()

    closer = threading.Thread(target=close_after_workers)
    closer.start()
    published: list[int] = []
    while not box.drained:
        published.extend(box.take(5, timeout=60.0))
        assert box.depth <= 8 + 1
    closer.join()
    assert published == list(range(301))
