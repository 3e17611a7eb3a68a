"""The SQLite outbox: order, ids, meta table, and durability across a SIGKILL."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from agent.spool import Spool


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
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
        from pathlib import Path
        from agent.spool import Spool
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
        child.wait(timeout=10)
    finally:
        if child.poll() is None:
            child.kill()
    with Spool(path) as spool:
        [msg] = spool.pending()
    assert (msg.topic, msg.payload) == ("fleet/v1/d/up/jobs/j", b"must-survive")
