"""The desk's records on disk (agent/fleet/enrollment/book.py): what survives a reopen, what is
forgotten, and a file from a newer controller refused."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from agent.fleet.enrollment.book import BookError, Enrolled, EnrollmentBook, Pending


def _pending(device: str, last_at: float, claim: str = "batch") -> Pending:
    return Pending(
        device, claim, None, "fp", "CSR", "r1", "pending", last_at, last_at, 1, 0, f"enroll:{device}"
    )


def test_a_waiting_device_not_heard_since_the_cutoff_is_forgotten_and_the_others_kept(tmp_path: Path) -> None:
    book = EnrollmentBook(tmp_path / "enrollment.sqlite")
    book.add_pending(_pending("old", 1000.0))
    book.add_pending(_pending("new", 5000.0, claim="other"))
    assert book.forget_pending_before(2000.0) == 1
    book.close()
    again = EnrollmentBook(tmp_path / "enrollment.sqlite")
    assert [p.device_id for p in again.pending_list()] == ["new"]
    assert again.pending_counts("other") == (1, 1)


def test_enrolling_spends_one_use_of_its_claim_and_leaves_the_pending_list(tmp_path: Path) -> None:
    book = EnrollmentBook(tmp_path / "enrollment.sqlite")
    book.add_pending(_pending("cam-1", 1.0))
    enrolled = Enrolled("cam-1", "fp", "ab", 2e9, 1e9, "batch", None, "r1", "CERT", "CHAIN")
    book.enroll(enrolled, spends_claim=True)
    book.enroll(enrolled, spends_claim=False)  # a renewal spends nothing
    assert (book.pending_total(), book.enrolled_total(), book.claim_uses("batch")) == (0, 1, 1)


def test_a_file_written_by_a_newer_controller_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "enrollment.sqlite"
    EnrollmentBook(path).close()
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA user_version=99")
    with pytest.raises(BookError, match="newer controller"):
        EnrollmentBook(path)
