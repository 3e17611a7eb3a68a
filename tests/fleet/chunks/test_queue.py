"""ChunkQueue: the chunk server's waiting chunks, merged per device and model (pure, threads real)."""

from __future__ import annotations

import threading
import time

from agent.fleet.chunks.queue import ChunkQueue, PendingChunks
from tests.waiting import patient


def add(
    queue: ChunkQueue, device: str, indices: list[int], *, sha: str = "a" * 64, corr: bytes = b"c"
) -> int | None:
    return queue.add(
        device=device,
        sha256=sha,
        chunk_size=1024,
        correlation=corr,
        indices=indices,
    )


def test_entries_come_out_first_come_first_served_and_a_repeat_keeps_its_place() -> None:
    queue = ChunkQueue()
    assert add(queue, "dev-a", [3, 1], corr=b"first") == 2
    assert add(queue, "dev-b", [0]) == 1
    assert add(queue, "dev-a", [1, 2, 3], corr=b"later") == 1  # only 2 is new
    assert queue.waiting_chunks == 4

    a = queue.take(0.1)
    b = queue.take(0.1)
    assert a is not None
    assert b is not None
    assert (a.device, list(a.indices), a.correlation) == ("dev-a", [3, 1, 2], b"first")
    assert (b.device, list(b.indices)) == ("dev-b", [0])
    assert queue.take(0.01) is None
    assert len(queue) == 0


def test_a_request_after_its_entry_was_taken_waits_at_the_back() -> None:
    queue = ChunkQueue()
    add(queue, "dev-a", [0])
    add(queue, "dev-b", [0])
    taken = queue.take(0.1)
    assert taken is not None
    assert taken.device == "dev-a"
    add(queue, "dev-a", [1])
    order = [queue.take(0.1), queue.take(0.1)]
    assert [(e.device, list(e.indices)) for e in order if e is not None] == [("dev-b", [0]), ("dev-a", [1])]


def test_models_and_chunk_sizes_are_separate_entries() -> None:
    queue = ChunkQueue()
    add(queue, "dev-a", [0], sha="a" * 64)
    add(queue, "dev-a", [0], sha="b" * 64)
    queue.add(device="dev-a", sha256="a" * 64, chunk_size=2048, correlation=None, indices=[0])
    assert len(queue) == 3


def test_a_full_queue_refuses_new_entries_but_merges_into_waiting_ones() -> None:
    queue = ChunkQueue(max_entries=1)
    assert add(queue, "dev-a", [0]) == 1
    assert add(queue, "dev-b", [0]) is None
    assert add(queue, "dev-a", [1]) == 1
    assert len(queue) == 1
    assert queue.waiting_chunks == 2


def test_take_waits_for_an_add_and_close_wakes_it_for_good() -> None:
    queue = ChunkQueue()
    got: list[PendingChunks | None] = []
    taker = threading.Thread(target=lambda: got.append(queue.take(60.0)))
    taker.start()
    time.sleep(0.05)  # most often the taker waits before the add; either order must give the entry
    add(queue, "dev-a", [7])
    taker.join(patient(60.0))
    assert [list(e.indices) for e in got if e is not None] == [[7]]

    add(queue, "dev-b", [1])
    started = time.monotonic()
    closer = threading.Timer(0.05, queue.close)
    closer.start()
    queue.take(0.01)  # dev-b's entry
    assert queue.take(60.0) is None  # woken by close, not after 60 s
    # Far from the timeout, so a loaded machine's late timer cannot blur the two.
    assert time.monotonic() - started < 30.0
    assert add(queue, "dev-c", [0]) is None  # closed: nothing goes in


def test_a_requests_place_counts_the_chunks_of_the_entries_before_it() -> None:
    queue = ChunkQueue()
    add(queue, "dev-a", [0, 1, 2])
    add(queue, "dev-b", [0, 1])
    add(queue, "dev-c", [5])
    assert queue.ahead(device="dev-c", sha256="a" * 64, chunk_size=1024) == (5, 1)  # at the back
    assert queue.ahead(device="dev-b", sha256="a" * 64, chunk_size=1024) == (3, 2)  # merged, mid-line
    add(queue, "dev-a", [3])
    assert queue.ahead(device="dev-a", sha256="a" * 64, chunk_size=1024) == (0, 4)
    assert queue.take(0.1) is not None
    assert queue.ahead(device="dev-a", sha256="a" * 64, chunk_size=1024) == (0, 0)  # taken: waits no more
    assert queue.ahead(device="dev-c", sha256="a" * 64, chunk_size=1024) == (2, 1)
    assert queue.waiting_chunks == 3


def test_deep_in_a_very_long_line_a_request_is_told_everything_waits_ahead() -> None:
    """Finding a place costs a walk of the line; past a few thousand entries the walk stops and the
    answer errs long (the device then waits longer, never asks early)."""
    queue = ChunkQueue()
    for n in range(5000):
        add(queue, f"dev-{n}", [0, 1])
    assert queue.ahead(device="dev-4500", sha256="a" * 64, chunk_size=1024) == (9998, 2)
    assert queue.ahead(device="dev-10", sha256="a" * 64, chunk_size=1024) == (20, 2)
