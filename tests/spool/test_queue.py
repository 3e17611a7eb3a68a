"""The SQLite outbox: order, ids, meta table, durability across a SIGKILL, caps, TTL, a full disk."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from agent.mqtt.session import RESERVATION, SessionCounter
from agent.spool.episodes import WRITE_RECOVERED_FREE_BYTES
from agent.spool.queue import ROW_OVERHEAD, Spool, SpoolEntry, SpoolWriteError
from agent.spool.settings import SpoolSettings
from agent.telemetry.series import series_of
from tests.small_disk import small_disk
from tests.waiting import patient


def test_add_pending_remove_in_id_order(tmp_path: Path) -> None:
    with Spool(tmp_path / "s.sqlite") as spool:
        ids = [spool.add(f"t/{i}", bytes([i]), 1, i % 2 == 0) for i in range(5)]
        assert ids == sorted(ids)
        assert len(set(ids)) == 5
        pending = spool.pending()
        assert [m.topic for m in pending] == [f"t/{i}" for i in range(5)]
        assert pending[0].payload == b"\x00"
        assert pending[0].retain
        assert not pending[1].retain
        assert [m.id for m in spool.pending(limit=2, after_id=ids[1])] == ids[2:4]
        spool.remove(ids[0])
        spool.remove(ids[0])  # unknown ids are ignored
        assert spool.count() == 4


def test_ids_are_never_reused(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    with Spool(path) as spool:
        last = spool.add("t", b"x", 1, False)
        spool.remove(last)
    with Spool(path) as spool:
        assert spool.add("t", b"y", 1, False) > last


def test_meta_survives_reopen(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    with Spool(path) as spool:
        assert spool.get_meta("mqtt.session") is None
        spool.set_meta("mqtt.session", "1")
        spool.set_meta("mqtt.session", "2")
    with Spool(path) as spool:
        assert spool.get_meta("mqtt.session") == "2"


def test_a_message_survives_sigkill_right_after_add(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    code = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from pathlib import Path
        from agent.spool.queue import Spool
        spool = Spool(Path({str(path)!r}))
        spool.add("fleet/v1/d/up/jobs/j", b"must-survive", 1, False)
        print("added", flush=True)
        time.sleep(60)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "added"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=patient(10))
    finally:
        if child.poll() is None:
            child.kill()
    with Spool(path) as spool:
        [msg] = spool.pending()
    assert (msg.topic, msg.payload) == ("fleet/v1/d/up/jobs/j", b"must-survive")


# -- caps, policies, time-to-live (issue 8) --------------------------------------------------


def _results(n: int, start: int = 0) -> list[SpoolEntry]:
    return [SpoolEntry("up/results/cam", f"r{start + i}".encode(), kind="result") for i in range(n)]


def test_at_the_row_cap_the_oldest_results_go_and_job_states_stay(tmp_path: Path) -> None:
    with Spool(tmp_path / "s.sqlite", SpoolSettings(max_rows=100)) as spool:
        spool.add("up/jobs/j1", b"QUEUED", 1, False)
        for start in range(0, 300, 20):
            spool.add_many(_results(20, start))
        assert spool.count() <= 100
        payloads = [m.payload for m in spool.pending(limit=1000)]
        assert payloads[0] == b"QUEUED"  # the job state survived 200 evictions
        assert payloads[-1] == b"r299"  # the newest result is there
        kept = [int(p[1:]) for p in payloads[1:]]
        assert kept == list(range(300 - len(kept), 300))  # the oldest results went, none in between
        stats = spool.stats()
        assert stats["evicted"] == 300 - len(kept)
        assert stats["rows"] == spool.count()


def test_job_states_go_in_even_beyond_the_cap(tmp_path: Path) -> None:
    with Spool(tmp_path / "s.sqlite", SpoolSettings(max_rows=100)) as spool:
        for i in range(120):
            spool.add(f"up/jobs/j{i}", b"s", 1, False)
        assert spool.count() == 120
        assert spool.add_many(_results(1)) == [None]  # no result to evict: the new one is refused
        assert spool.stats()["dropped_at_cap"] == 1


def test_the_byte_cap_counts_payload_topic_and_row_overhead(tmp_path: Path) -> None:
    settings = SpoolSettings(max_bytes=1024 * 1024, max_rows=1_000_000)
    payload = b"x" * 1000
    with Spool(tmp_path / "s.sqlite", settings) as spool:
        for _ in range(30):
            spool.add_many([SpoolEntry("up/results/cam", payload, kind="result") for _ in range(100)])
        assert spool.stats()["bytes"] <= settings.max_bytes
        per_row = len(payload) + len("up/results/cam") + ROW_OVERHEAD
        assert spool.count() == spool.stats()["bytes"] // per_row
        assert spool.count() > 900  # it fills up to the cap, it does not empty itself
    # The file holds what the cap allows (SQLite pages and b-tree slack on top, no more).
    assert (tmp_path / "s.sqlite").stat().st_size <= 1.5 * settings.max_bytes


def test_the_stats_carry_the_caps_that_the_spool_alert_compares_against(tmp_path: Path) -> None:
    settings = SpoolSettings(max_bytes=5 * 1024 * 1024, max_rows=1234)
    with Spool(tmp_path / "s.sqlite", settings) as spool:
        stats = spool.stats()
    assert (stats["max_rows"], stats["max_bytes"]) == (1234.0, 5 * 1024 * 1024.0)
    # Gauges of their own on /metrics (not spool counters): dashboards/edge-fleet-alerts.yml divides by them.
    for name in ("max_rows", "max_bytes"):
        found = series_of(f"spool.{name}")
        assert found is not None
        assert (found.metric, found.kind, found.labels) == (f"edge_spool_{name}", "gauge", ())


def test_drop_newest_keeps_the_start_of_the_outage(tmp_path: Path) -> None:
    settings = SpoolSettings(max_rows=100, results_at_cap="drop_newest")
    with Spool(tmp_path / "s.sqlite", settings) as spool:
        for start in range(0, 300, 20):
            spool.add_many(_results(20, start))
        assert [m.payload for m in spool.pending(limit=1000)] == [f"r{i}".encode() for i in range(100)]
        assert spool.stats()["dropped_at_cap"] == 200
        assert spool.stats()["evicted"] == 0


def test_reaching_the_cap_is_logged_once_per_episode(tmp_path: Path) -> None:
    with capture_logs() as logs, Spool(tmp_path / "s.sqlite", SpoolSettings(max_rows=100)) as spool:
        for start in range(0, 1000, 10):
            spool.add_many(_results(10, start))
        for m in spool.pending(limit=1000):  # the replay empties it: the episode ends
            spool.remove(m.id)
        spool.add_many(_results(10))
    events = [e["event"] for e in logs if e["event"].startswith("spool.cap")]
    assert events == ["spool.cap.reached", "spool.cap.cleared"]


def test_expired_results_are_deleted_instead_of_replayed(tmp_path: Path) -> None:
    now = [1000.0]
    settings = SpoolSettings(results_ttl_s=60.0)
    with Spool(tmp_path / "s.sqlite", settings, clock=lambda: now[0]) as spool:
        spool.add_many(_results(3))
        spool.add("up/jobs/j", b"state", 1, False)  # job states never expire
        now[0] += 30.0
        spool.add_many(_results(2, 3))
        assert [m.expires_at for m in spool.pending(limit=1)] == [1060.0]
        now[0] += 31.0  # the first three are 61 s old, the last two 31 s
        assert [m.payload for m in spool.pending(limit=3)] == [b"state", b"r3", b"r4"]
        assert spool.stats()["expired"] == 3
        assert spool.count() == 3


def test_a_spool_of_the_previous_release_is_migrated_and_its_rows_kept_as_states(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    db = sqlite3.connect(path)
    db.executescript(
        "CREATE TABLE outbox (id INTEGER PRIMARY KEY AUTOINCREMENT, topic TEXT NOT NULL,"
        " payload BLOB NOT NULL, qos INTEGER NOT NULL, retain INTEGER NOT NULL);"
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
        "INSERT INTO outbox (topic, payload, qos, retain) VALUES ('up/jobs/j', x'01', 1, 0);"
    )
    db.commit()
    db.close()
    with Spool(path, SpoolSettings(max_rows=100)) as spool:
        assert spool.count() == 1
        for start in range(0, 200, 50):
            spool.add_many(_results(50, start))
        assert spool.pending(limit=1)[0].payload == b"\x01"  # never evicted, never expired


def test_a_batch_is_stored_in_one_transaction_in_order(tmp_path: Path) -> None:
    with Spool(tmp_path / "s.sqlite") as spool:
        ids = spool.add_many(_results(50))
        assert all(i is not None for i in ids)
        assert ids == sorted(ids)  # type: ignore[type-var]
        assert [m.payload for m in spool.pending(limit=100)] == [f"r{i}".encode() for i in range(50)]


# -- a full disk (a real tmpfs with 0 bytes free) -------------------------------------------


def test_on_a_full_disk_results_are_dropped_and_counted_with_one_warning_and_states_raise(
    tmp_path: Path,
) -> None:
    with small_disk(tmp_path / "disk", "4m") as disk, Spool(disk.path / "s.sqlite") as spool:
        sent = spool.add("up/jobs/j", b"before", 1, False)
        disk.fill()
        with capture_logs() as logs:
            for start in range(0, 1000, 10):
                assert spool.add_many(_results(10, start)) == [None] * 10
            with pytest.raises(SpoolWriteError, match="free disk space"):
                spool.add("up/jobs/j", b"FAILED", 1, False)
            spool.remove(sent)  # acknowledged, but the DELETE cannot be written either
            assert spool.pending() == []  # not sent twice by this process
        warnings = [e for e in logs if e["log_level"] in ("warning", "error")]
        assert [e["event"] for e in warnings] == ["spool.write.failed"]
        assert spool.stats()["dropped_write_failed"] == 1000
        assert spool.stats()["write_failing"] == 1.0
        disk.free()
        with capture_logs() as logs:
            assert spool.add("up/jobs/j", b"after", 1, False) is not None
        assert [e["event"] for e in logs] == ["spool.write.recovered"]
        assert [m.payload for m in spool.pending()] == [b"after"]  # the late DELETE went through
        assert spool.stats()["write_failing"] == 0.0


def test_a_write_squeezed_in_between_two_failures_does_not_end_the_episode(tmp_path: Path) -> None:
    """Issue 20.16: a disk hovering at full (a few pages freed, then taken again) is one episode: one
    ``spool.write.failed``; it ends, with one ``spool.write.recovered``, once a write succeeds with
    WRITE_RECOVERED_FREE_BYTES free."""
    with small_disk(tmp_path / "disk", "4m") as disk, Spool(disk.path / "s.sqlite") as spool:
        spool.add("up/jobs/j", b"before", 1, False)
        disk.fill()
        with capture_logs() as logs:
            assert spool.add_many(_results(10)) == [None] * 10
            disk.free_some(256 * 1024)  # some pages back: far below the margin
            assert spool.add("up/jobs/j", b"squeezed in", 1, False) is not None
            assert spool.stats()["write_failing"] == 1.0  # still the same episode
            disk.fill()
            assert spool.add_many(_results(10, 10)) == [None] * 10
            disk.free()
            assert disk.free_bytes() >= WRITE_RECOVERED_FREE_BYTES
            assert spool.add("up/jobs/j", b"after", 1, False) is not None
        events = [e["event"] for e in logs if e["event"].startswith("spool.write")]
        assert events == ["spool.write.failed", "spool.write.recovered"]
        assert spool.stats()["write_failing"] == 0.0
        assert spool.stats()["dropped_write_failed"] == 20


def test_the_session_counter_needs_no_disk_write_and_stays_monotonic(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", "4m") as disk:
        with Spool(disk.path / "s.sqlite") as spool:
            first = SessionCounter(spool).next()
        with Spool(disk.path / "s.sqlite") as spool:
            counter = SessionCounter(spool)
            disk.fill()
            numbers = [counter.next() for _ in range(RESERVATION + 5)]  # beyond the reservation: no write
            assert numbers == sorted(set(numbers))
            assert numbers[0] > first
            disk.free()
            numbers.append(counter.next())  # the write works again: a new reservation
        with Spool(disk.path / "s.sqlite") as spool:
            assert SessionCounter(spool).next() > max(numbers)  # after a restart: still higher
