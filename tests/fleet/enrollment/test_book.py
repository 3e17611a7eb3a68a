"""The desk's records (agent/fleet/enrollment/book.py), in their SQLite file and in a real PostgreSQL
(enrollment/pg_book.py; each test runs on both where it is not about one of them): what survives a
reopen, what is forgotten, a claim's uses counted once however many controllers spend them, a file
from a newer controller refused; on PostgreSQL, a second controller on another host (another state
dir) sees the same records, and a holder whose lease was taken changes nothing."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from agent.fleet.controller.db_lease import DatabaseLease
from agent.fleet.enrollment.book import BookError, ClaimUsedUpError, Enrolled, EnrollmentBook, Pending
from agent.fleet.enrollment.pg_book import PostgresEnrollmentBook, open_enrollment_book
from agent.fleet.statedb.postgres import FencedError, StateDatabase
from tests.postgres_server import PostgresServer

#: Opens the test's book as a controller whose ``state_dir`` is the given directory would.
OpenBook = Callable[[Path], EnrollmentBook]


@pytest.fixture(params=["sqlite", "postgresql"])
def open_book(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OpenBook]:
    """The book in ``{state_dir}/enrollment.sqlite``, or in a fresh database of the tests' PostgreSQL
    (the same one whatever the state dir, as for two controllers on two hosts)."""
    opened: list[EnrollmentBook] = []
    address = None
    if request.param == "postgresql":
        server: PostgresServer = request.getfixturevalue("postgres")
        address = server.conninfo(server.new_database())

    def opening(state_dir: Path) -> EnrollmentBook:
        database = None if address is None else StateDatabase(address, name="enrollment")
        opened.append(open_enrollment_book(state_dir / "enrollment.sqlite", database))
        return opened[-1]

    yield opening
    for book in opened:
        book.close()


@pytest.fixture
def address(postgres: PostgresServer) -> str:
    return postgres.conninfo(postgres.new_database())


def _pending(device: str, last_at: float, claim: str = "batch") -> Pending:
    return Pending(
        device, claim, None, "fp", "CSR", "r1", "pending", last_at, last_at, 1, 0, f"enroll:{device}"
    )


def _enrolled(device: str, serial: str = "ab", claim: str = "batch") -> Enrolled:
    return Enrolled(device, "fp", serial, 2e9, 1e9, claim, None, "r1", f"CERT {serial}", "CHAIN")


def test_a_waiting_device_not_heard_since_the_cutoff_is_forgotten_and_the_others_kept(
    open_book: OpenBook, tmp_path: Path
) -> None:
    book = open_book(tmp_path)
    book.add_pending(_pending("old", 1000.0))
    book.add_pending(_pending("new", 5000.0, claim="other"))
    assert book.forget_pending_before(2000.0) == 1
    book.close()
    again = open_book(tmp_path)
    assert [p.device_id for p in again.pending_list()] == ["new"]
    assert again.pending_counts("other") == (1, 1)
    assert again.pending_counts("batch") == (1, 0)


def test_enrolling_spends_one_use_of_its_claim_and_leaves_the_pending_list(
    open_book: OpenBook, tmp_path: Path
) -> None:
    book = open_book(tmp_path)
    book.add_pending(_pending("cam-1", 1.0))
    enrolled = _enrolled("cam-1")
    book.enroll(enrolled, spends_claim=True)
    book.enroll(enrolled, spends_claim=False)  # a renewal spends nothing
    assert (book.pending_total(), book.enrolled_total(), book.claim_uses("batch")) == (0, 1, 1)
    assert book.enrolled("cam-1") == enrolled


def test_registering_rejecting_and_asking_again_are_kept_and_replace_what_was_there(
    open_book: OpenBook, tmp_path: Path
) -> None:
    book = open_book(tmp_path)
    book.register("cam-1", None)
    book.register("cam-1", "SN-9")  # the second registration of an id replaces the first
    book.register(None, "SN-7", source="file")
    book.add_pending(_pending("cam-2", 1.0))
    book.touch_pending("cam-2", contested=False, at=5.0)
    book.touch_pending("cam-2", contested=True, at=6.0)
    assert book.reject("cam-2", "unknown") is True
    assert book.reject("cam-2", "still unknown") is False  # no longer pending; the reason replaced
    book.close()
    again = open_book(tmp_path)
    registered = again.registration_of_id("cam-1")
    assert registered is not None
    assert registered.serial == "SN-9"
    assert again.registration_of_serial("SN-7") is not None
    assert [(r.device_id, r.serial, r.source) for r in again.registrations()] == [
        ("cam-1", "SN-9", "cli"),
        (None, "SN-7", "file"),
    ]
    assert again.rejected("cam-2") == "still unknown"
    again.register("cam-2", None)  # a registration lifts the rejection
    assert again.rejected("cam-2") is None
    again.forget_registrations("file")
    assert again.registration_of_serial("SN-7") is None
    again.add_pending(_pending("cam-3", 1.0))
    again.touch_pending("cam-3", contested=True, at=9.0)
    waiting = again.pending("cam-3")
    assert waiting is not None
    assert (waiting.asks, waiting.contested, waiting.last_at) == (1, 1, 9.0)


def test_a_claim_spent_at_its_limit_records_nothing(open_book: OpenBook, tmp_path: Path) -> None:
    book = open_book(tmp_path)
    book.add_pending(_pending("cam-2", 1.0))
    book.enroll(_enrolled("cam-1"), spends_claim=True, claim_limit=1)
    with pytest.raises(ClaimUsedUpError, match="claim batch has enrolled 1 of its 1 devices"):
        book.enroll(_enrolled("cam-2"), spends_claim=True, claim_limit=1)
    with pytest.raises(ClaimUsedUpError):
        book.enroll(_enrolled("cam-3", claim="none-left"), spends_claim=True, claim_limit=0)
    assert [e.device_id for e in book.enrolled_list()] == ["cam-1"]
    assert book.pending("cam-2") is not None  # still waiting: the refused enrollment left it there
    assert (book.claim_uses("batch"), book.claim_uses("none-left")) == (1, 0)


def test_two_controllers_spending_one_claim_at_once_enroll_exactly_its_uses(
    open_book: OpenBook, tmp_path: Path
) -> None:
    """Each book on its own connection, as two controllers are; the limit is checked where the use
    is counted, so the two never pass it between them."""
    books = [open_book(tmp_path / "one"), open_book(tmp_path / "two")]
    if not isinstance(books[0], PostgresEnrollmentBook):
        books[1].close()  # SQLite: a second connection to the first file (one disk)
        books[1] = open_book(tmp_path / "one")
    start = threading.Barrier(2)
    issued: list[list[str]] = [[], []]

    def spend(which: int) -> None:
        start.wait()
        for n in range(15):
            device = f"cam-{which}-{n}"
            try:
                books[which].enroll(_enrolled(device), spends_claim=True, claim_limit=10)
            except ClaimUsedUpError:
                continue
            issued[which].append(device)

    threads = [threading.Thread(target=spend, args=(which,)) for which in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(issued[0]) + len(issued[1]) == 10
    assert books[0].claim_uses("batch") == books[1].claim_uses("batch") == 10
    assert sorted(e.device_id for e in books[1].enrolled_list()) == sorted(issued[0] + issued[1])


def test_a_file_written_by_a_newer_controller_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "enrollment.sqlite"
    EnrollmentBook(path).close()
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA user_version=99")
    with pytest.raises(BookError, match="newer controller"):
        EnrollmentBook(path)


def test_a_controller_on_another_host_sees_the_pending_the_enrolled_and_the_claims_uses(
    address: str, tmp_path: Path
) -> None:
    """Two state dirs, no shared disk, one database: what the first controller wrote, the second
    knows; nothing of it is in either state dir."""
    first = open_enrollment_book(tmp_path / "one" / "enrollment.sqlite", StateDatabase(address))
    second = open_enrollment_book(tmp_path / "two" / "enrollment.sqlite", StateDatabase(address))
    try:
        first.add_pending(_pending("cam-wait", 100.0))
        enrolled = _enrolled("cam-1", serial="0a1b")
        first.enroll(enrolled, spends_claim=True, claim_limit=2)
        waiting = second.pending("cam-wait")
        assert waiting is not None
        assert (waiting.claim, waiting.csr_pem, waiting.client) == ("batch", "CSR", "enroll:cam-wait")
        # The certificate a repeated request gets again is the one the first controller issued.
        assert second.enrolled("cam-1") == enrolled
        assert second.claim_uses("batch") == 1
        second.enroll(_enrolled("cam-2"), spends_claim=True, claim_limit=2)
        with pytest.raises(ClaimUsedUpError):  # the first controller's use counts for the second
            second.enroll(_enrolled("cam-3"), spends_claim=True, claim_limit=2)
        assert first.claim_uses("batch") == 2
        assert not (tmp_path / "one").exists()
        assert not (tmp_path / "two").exists()
    finally:
        first.close()
        second.close()


def test_a_holder_whose_lease_was_taken_changes_nothing_in_the_book(address: str, tmp_path: Path) -> None:
    StateDatabase(address).migrate()
    old_lease = DatabaseLease(StateDatabase(address, name="lease"), "fleet-a", tmp_path / "one", ttl_s=30)
    new_lease = DatabaseLease(StateDatabase(address, name="lease"), "fleet-a", tmp_path / "two", ttl_s=30)
    assert old_lease.acquire()
    old = PostgresEnrollmentBook(StateDatabase(address), fence=old_lease.fence)
    new: PostgresEnrollmentBook | None = None
    try:
        old.add_pending(_pending("cam-wait", 100.0))
        with psycopg.connect(address, autocommit=True) as pg:  # the holder froze past its ttl
            pg.execute("UPDATE controller_lease SET expires_at = clock_timestamp() - interval '1 second'")
        assert new_lease.acquire()
        new = PostgresEnrollmentBook(StateDatabase(address), fence=new_lease.fence)
        refused: list[Callable[[], object]] = [
            lambda: old.enroll(_enrolled("cam-wait"), spends_claim=True, claim_limit=5),
            lambda: old.add_pending(_pending("cam-other", 200.0)),
            lambda: old.reject("cam-wait", "no"),
            lambda: old.register("cam-x", None),
            lambda: old.forget_pending_before(1e12),
        ]
        for change in refused:
            with pytest.raises(FencedError, match="was taken"):
                change()
        assert [p.device_id for p in new.pending_list()] == ["cam-wait"]
        assert (new.enrolled_total(), new.claim_uses("batch"), new.registrations()) == (0, 0, [])
        assert new.rejected("cam-wait") is None
        new.enroll(_enrolled("cam-wait"), spends_claim=True, claim_limit=5)  # the holder's goes in
        assert (new.pending_total(), new.claim_uses("batch")) == (0, 1)
    finally:
        old.close()
        if new is not None:
            new.close()
        new_lease.release()
        old_lease.release()
