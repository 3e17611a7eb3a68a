"""The rollout store on a damaged file and a full disk: real SQLite files, a real small tmpfs.

A damaged or emptied file is refused with the store's own error naming it, at open or at the first
query that meets the damage; a full disk fails a transition whole, warns once per episode, and the
store writes again as soon as space returns, with its WAL cut back, without being reopened.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from agent.fleet.rollout.gate import DeviceEnd
from agent.fleet.rollout.records import DeviceStep, RolloutPlan, RolloutState, WaveState
from agent.fleet.rollout.store import (
    WAL_LIMIT_BYTES,
    RolloutStore,
    RolloutStoreError,
    StoreDamagedError,
    StoreFullError,
)
from tests.small_disk import SmallDisk, small_disk

ROOT = Path(__file__).resolve().parents[3]
PAGE = 4096
#: What the store says of a 0-byte file (docs/fleet.md quotes it).
EMPTIED = "0 bytes: a store is created whole, so this one was emptied after it existed"


def _plan(rollout_id: str, devices: list[str], slot: str = "main") -> RolloutPlan:
    return RolloutPlan(
        rollout_id, slot, f"job-{rollout_id}", "5", [devices[:5], devices[5:]], spec={"waves": "5,100%"}
    )


def _store_with_rollouts(path: Path, rollouts: int = 3, devices: int = 100) -> None:
    """A closed store of ``rollouts`` rollouts whose first wave was sent (about 20 pages)."""
    store = RolloutStore(path)
    for r in range(rollouts):
        names = [f"jet-{r}-{i:03d}" for i in range(devices)]
        store.create(_plan(f"r{r}", names, slot=f"s{r}"))
        store.set_wave(f"r{r}", 0, WaveState.RUNNING)
        for device in names[:5]:
            store.mark_sending(f"r{r}", device)
            store.mark_sent(f"r{r}", device)
    store.close()


def damage_every_third_page(path: Path, first: int) -> None:
    """Overwrite pages ``first``, ``first + 3``, ... of the SQLite file with garbage (issue 20, point 7)."""
    data = bytearray(path.read_bytes())
    assert len(data) >= 6 * PAGE, "too small a store to damage"
    for page in range(first, len(data) // PAGE, 3):
        data[page * PAGE : (page + 1) * PAGE] = b"\xa5" * PAGE
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("first", [1, 2])
def test_a_store_damaged_every_third_page_is_refused_at_open_naming_the_file(
    tmp_path: Path, first: int
) -> None:
    path = tmp_path / "rollouts.sqlite"
    _store_with_rollouts(path)
    damage_every_third_page(path, first)
    damaged = path.read_bytes()
    with pytest.raises(StoreDamagedError) as caught:
        RolloutStore(path)
    message = str(caught.value)
    assert f"rollout store {path} is damaged (" in message
    assert "move rollouts.sqlite and its -wal and -shm files aside" in message
    assert "restore them from a backup" in message
    assert "\n" not in message
    assert path.read_bytes() == damaged, "the damaged file was changed"


def test_damage_met_after_open_is_the_stores_error_naming_the_file(tmp_path: Path) -> None:
    """The store passed its check at open; another writer then points ``events`` at a page that
    does not exist (a damaged schema, committed through SQLite): the next query meets the damage."""
    path = tmp_path / "rollouts.sqlite"
    _store_with_rollouts(path, rollouts=1)
    store = RolloutStore(path)
    assert [what for what, _ in store.events("r0")][:2] == ["created", "wave"]
    vandal = sqlite3.connect(path, isolation_level=None)
    vandal.execute("PRAGMA writable_schema=ON")
    vandal.execute("UPDATE sqlite_master SET rootpage = 99999 WHERE name = 'events'")
    cookie = vandal.execute("PRAGMA schema_version").fetchone()[0]
    vandal.execute(f"PRAGMA schema_version={cookie + 1}")  # so the store's connection rereads the schema
    vandal.close()
    with pytest.raises(StoreDamagedError, match=r"rollouts\.sqlite is damaged \(.*malformed"):
        store.events("r0")
    with pytest.raises(StoreDamagedError, match=r"rollouts\.sqlite is damaged"):
        store.note("r0", "anything")  # a transition meets it too, and rolls back cleanly
    store.close()


def test_an_emptied_store_is_refused_and_a_missing_one_is_created_whole(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.sqlite"
    _store_with_rollouts(path, rollouts=2)
    path.write_bytes(b"")  # what a failed restore or `> rollouts.sqlite` leaves
    with pytest.raises(
        StoreDamagedError, match=r"0 bytes: a store is created whole, so this one was emptied"
    ):
        RolloutStore(path)
    assert path.stat().st_size == 0, "the emptied file was taken for a new store"

    path.unlink()  # deleting it is how an operator starts afresh
    store = RolloutStore(path)
    assert store.open_rollouts() == []
    store.close()
    assert path.stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollouts.sqlite"], "the build file was left"


def test_a_large_wal_left_by_an_earlier_run_is_truncated_at_open(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.sqlite"
    _store_with_rollouts(path, rollouts=1)
    # Another connection that never checkpoints grows the WAL, as a controller killed with a large
    # WAL (or SQLite's default 1,000-page checkpoint) leaves it.
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("PRAGMA wal_autocheckpoint=0")
    for i in range(300):
        other.execute("INSERT INTO events (rollout_id, at, what, detail) VALUES ('r0', ?, 'pad', '{}')", (i,))
    wal = path.with_name("rollouts.sqlite-wal")
    assert wal.stat().st_size > 300 * PAGE
    store = RolloutStore(path)
    assert wal.stat().st_size == 0
    assert len(store.events("r0")) > 300
    store.close()
    other.close()


@pytest.fixture
def four_mb(tmp_path: Path) -> Iterator[SmallDisk]:
    """A real 4 MiB filesystem (tmpfs), as the state disk of issue 20 point 10; needs root."""
    with small_disk(tmp_path / "disk", "4m") as disk:
        yield disk


def _wal_bytes(path: Path) -> int:
    wal = path.with_name(path.name + "-wal")
    return wal.stat().st_size if wal.exists() else 0


def test_on_a_4mb_disk_a_100_device_rollout_runs_to_the_end_with_the_wal_kept_small(
    four_mb: SmallDisk,
) -> None:
    """With SQLite's default checkpoint (1,000 pages) the WAL alone grew to 3.9 MB and filled this disk."""
    path = four_mb.path / "rollouts.sqlite"
    store = RolloutStore(path)
    names = [f"jet-{i:03d}" for i in range(100)]
    for r in range(3):  # three rollouts of 100 devices, each device three transitions: ~900 commits
        rollout = f"r{r}"
        store.create(_plan(rollout, names))
        peak = 0
        for wave, devices in enumerate((names[:5], names[5:])):
            store.set_wave(rollout, wave, WaveState.RUNNING)
            for device in devices:
                store.mark_sending(rollout, device)
                store.mark_sent(rollout, device)
                store.record_job(rollout, device, DeviceEnd.ACTIVE, {"shadow": {"frames": 50}})
                peak = max(peak, _wal_bytes(path))
            store.set_wave(rollout, wave, WaveState.DONE)
        store.set_state(rollout, RolloutState.DONE)
        assert peak <= WAL_LIMIT_BYTES * 1.1, peak
    assert all(row.step is DeviceStep.ENDED for row in store.devices("r2"))
    store.close()


def test_a_store_opened_on_a_full_disk_says_so_and_opens_once_space_is_back(four_mb: SmallDisk) -> None:
    path = four_mb.path / "rollouts.sqlite"
    _store_with_rollouts(path, rollouts=1)
    four_mb.fill()
    with pytest.raises(RolloutStoreError) as refused:
        RolloutStore(path)  # SQLite cannot make its 32 KiB -shm file
    doc = " ".join((ROOT / "docs" / "fleet.md").read_text().split())
    quoted = doc.split("`rollout store ...: cannot open: its disk is full")[1].split("`")[0]
    shown = re.escape(f"rollout store {path}: cannot open: its disk is full{quoted}").replace(r"\.\.\.", ".*")
    assert re.fullmatch(shown, str(refused.value)), (shown, str(refused.value))
    four_mb.free()
    store = RolloutStore(path)
    assert store.open_rollouts() == ["r0"]
    store.close()


def test_a_full_disk_fails_transitions_whole_warns_once_and_the_store_writes_again_without_a_reopen(
    four_mb: SmallDisk,
) -> None:
    path = four_mb.path / "rollouts.sqlite"
    store = RolloutStore(path)
    names = [f"jet-{i:03d}" for i in range(100)]
    store.create(_plan("r1", names))
    store.set_wave("r1", 0, WaveState.RUNNING)
    for device in names[:50]:  # a WAL of some size when the disk fills
        store.mark_sending("r1", device)
    with capture_logs() as logs:
        four_mb.fill()
        refusals: list[str] = []
        for device in names[50:]:
            try:
                store.mark_sending("r1", device)
            except StoreFullError as exc:
                refusals.append(str(exc))
                # The truncated WAL gave some bytes back: take them too, so the episode goes on.
                four_mb.fill()
        failed = len(refusals)
        assert failed >= 10, failed
        assert all(f"rollout store {path}: the disk is full (0 bytes free)" in r for r in refusals), refusals[
            0
        ]
        steps = {row.device: row.step for row in store.devices("r1")}
        stored = [d for d in names[50:] if steps[d] is DeviceStep.SENDING]
        events = [d["device"] for what, d in store.events("r1") if what == "device"]
        assert events == names[:50] + stored, "a failed transition left its event or its row behind"
        assert len(stored) == 50 - failed
        four_mb.free()
        store.mark_sent("r1", names[0])  # no reopen: the next transition commits
        assert _wal_bytes(path) < 64 * 1024, "the WAL was not truncated before the first write"
        store.mark_sent("r1", names[1])
    assert store.devices("r1")[0].step is DeviceStep.SENT
    events = [(e["event"], e["log_level"]) for e in logs if e["event"].startswith("fleet.rollout_store")]
    assert events == [
        ("fleet.rollout_store.disk_full", "warning"),
        ("fleet.rollout_store.disk_writable", "info"),
    ]
    ended = next(e for e in logs if e["event"] == "fleet.rollout_store.disk_writable")
    assert ended["failed_writes"] == failed
    assert store.check() == []
    store.close()


def test_the_messages_docs_fleet_md_shows_are_the_ones_raised() -> None:
    doc = " ".join((ROOT / "docs" / "fleet.md").read_text().split())
    damaged = StoreDamagedError(Path("/var/lib/edge-fleet-controller/rollouts.sqlite"), "...")
    assert f"`error: {damaged}`" in doc
    assert f"`{EMPTIED}`" in doc
    quoted = doc.split("(`rollout store ...: ")[1].split("`")[0].removesuffix("...")
    assert str(StoreFullError(Path("rollouts.sqlite"), 0)).startswith(
        f"rollout store rollouts.sqlite: {quoted}"
    )
