"""Rollout state in SQLite: rollouts, their waves, every device's step and end, and a log of transitions.

The fleet controller keeps nothing that matters only in memory: each transition (a wave starts, a
device's desired state is about to be sent, was sent, its job ended, a wave's gate held or tripped,
the rollout paused, aborted, finished, was superseded) is one SQLite transaction, in WAL mode with
``synchronous=FULL``, together with its row in ``events``. A ``kill -9`` or a power cut therefore
leaves the store at a transition boundary, never between the two halves of one.

How a restarted controller deploys no device twice and skips none: a device goes ``PLANNED ->
SENDING -> SENT -> ENDED``. ``SENDING`` is written *before* the signed desired state is published,
``SENT`` after the broker acknowledged it. After a crash, :meth:`RolloutStore.resume` lists the
current wave's devices by step: ``PLANNED`` ones were never published (send them), ``SENDING`` ones
may or may not have been (publish them again with the *same* job id and manifest: the desired state
is retained and idempotent, so a device that already has it sees the same job, not a second one),
``SENT`` ones wait for their job's end, ``ENDED`` ones are done.

One rollout per slot and device at a time: :meth:`RolloutStore.create` refuses a rollout whose
devices overlap a running or paused rollout on the same slot (:class:`OverlapError` names the
devices), unless it names that rollout in ``supersedes``: then, in the same transaction, the old
rollout ends ``SUPERSEDED`` and its unsent devices are cancelled.

This module holds the transitions; the states and rows are :mod:`agent.fleet.rollout.records`, the
queries :mod:`agent.fleet.rollout.store_reads`, the file (schema, migrations, transactions, a
damaged file, a full disk) :mod:`agent.fleet.rollout.store_file`.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from agent.fleet.rollout.gate import DeviceEnd
from agent.fleet.rollout.records import (
    DEVICE_MOVES,
    OPEN_STATES,
    ROLLOUT_MOVES,
    WAVE_MOVES,
    DeviceStep,
    RolloutPlan,
    RolloutState,
    WaveState,
)
from agent.fleet.rollout.store_file import OverlapError, RolloutNotFoundError, RolloutStoreError
from agent.fleet.rollout.store_reads import StoreReads


class RolloutStore(StoreReads):
    """The controller's rollout state in the SQLite file at ``path`` (created if missing).

    Thread-safe: one connection behind one lock; every public method that changes something is one
    transaction. ``clock`` gives timestamps (seconds since the epoch).
    """

    def _event(self, db: sqlite3.Connection, rollout_id: str, what: str, **detail: Any) -> None:
        db.execute(
            "INSERT INTO events (rollout_id, at, what, detail) VALUES (?, ?, ?, ?)",
            (rollout_id, self._clock(), what, json.dumps(detail, sort_keys=True)),
        )

    # -- creating ----------------------------------------------------------------------------------

    def create(self, plan: RolloutPlan) -> None:
        """Store a new rollout with its waves and devices (all PLANNED), refusing an overlap.

        Raises :class:`OverlapError` when a running or paused rollout on ``plan.slot`` holds any of
        the devices and is not ``plan.supersedes``; superseding ends that rollout ``SUPERSEDED`` and
        cancels its unsent devices in the same transaction.
        """
        devices = [device for wave in plan.waves for device in wave]
        if len(set(devices)) != len(devices):
            raise RolloutStoreError(f"rollout {plan.rollout_id}: a device appears in two waves")
        now = self._clock()
        with self._transaction() as db:
            if db.execute("SELECT 1 FROM rollouts WHERE id = ?", (plan.rollout_id,)).fetchone():
                raise RolloutStoreError(f"rollout {plan.rollout_id} exists already; pick another id")
            owners = self._owners(db, plan.slot, devices)
            for owner, owned in sorted(owners.items()):
                if owner != plan.supersedes:
                    raise OverlapError(owner, plan.slot, owned)
            if plan.supersedes is not None:
                self._supersede(db, plan.supersedes, plan.rollout_id, now)
            db.execute(
                "INSERT INTO rollouts (id, slot, job_id, to_version, state, spec, supersedes, created_at, "
                "updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    plan.rollout_id,
                    plan.slot,
                    plan.job_id,
                    plan.to_version,
                    RolloutState.RUNNING.value,
                    json.dumps(dict(plan.spec), sort_keys=True),
                    plan.supersedes,
                    now,
                    now,
                ),
            )
            for index, wave in enumerate(plan.waves):
                db.execute(
                    "INSERT INTO waves (rollout_id, idx, state) VALUES (?, ?, ?)",
                    (plan.rollout_id, index, WaveState.WAITING.value),
                )
                db.executemany(
                    "INSERT INTO devices (rollout_id, device, wave, from_version, to_version, job_id, step, "
                    "updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [
                        (
                            plan.rollout_id,
                            device,
                            index,
                            plan.from_versions.get(device),
                            plan.to_version,
                            plan.job_id,
                            DeviceStep.PLANNED.value,
                            now,
                        )
                        for device in wave
                    ],
                )
            self._event(
                db,
                plan.rollout_id,
                "created",
                devices=len(devices),
                waves=len(plan.waves),
                supersedes=plan.supersedes,
            )

    def _owners(self, db: sqlite3.Connection, slot: str, devices: Sequence[str]) -> dict[str, list[str]]:
        """Open rollouts on ``slot`` that hold any of ``devices``.

        A device whose job already ended still belongs to its open rollout: an abort with rollback
        may yet move it back, which a second rollout would contradict.
        """
        db.execute("CREATE TEMP TABLE IF NOT EXISTS wanted (device TEXT PRIMARY KEY)")
        db.execute("DELETE FROM wanted")
        db.executemany("INSERT OR IGNORE INTO wanted VALUES (?)", [(d,) for d in devices])
        rows = db.execute(
            "SELECT r.id, d.device FROM devices d JOIN rollouts r ON r.id = d.rollout_id "
            "JOIN wanted w ON w.device = d.device "
            "WHERE r.slot = ? AND r.state IN (?, ?) ORDER BY r.id, d.device",
            (slot, *OPEN_STATES),
        ).fetchall()
        owners: dict[str, list[str]] = {}
        for rollout_id, device in rows:
            owners.setdefault(rollout_id, []).append(device)
        return owners

    def _supersede(self, db: sqlite3.Connection, old: str, new: str, now: float) -> None:
        row = db.execute("SELECT state FROM rollouts WHERE id = ?", (old,)).fetchone()
        if row is None:
            raise RolloutStoreError(f"supersedes={old}: no such rollout")
        ROLLOUT_MOVES.check(RolloutState(row[0]), RolloutState.SUPERSEDED, who=f"rollout {old}")
        db.execute(
            "UPDATE rollouts SET state = ?, reason = ?, updated_at = ? WHERE id = ?",
            (RolloutState.SUPERSEDED.value, f"superseded by {new}", now, old),
        )
        self._cancel_unsent(db, old, now, f"superseded by {new}")
        self._event(db, old, "superseded", by=new)

    def _cancel_unsent(self, db: sqlite3.Connection, rollout_id: str, now: float, why: str) -> None:
        db.execute(
            "UPDATE devices SET step = ?, updated_at = ? WHERE rollout_id = ? AND step = ?",
            (DeviceStep.CANCELLED.value, now, rollout_id, DeviceStep.PLANNED.value),
        )
        # The wave's own reason ("soaking 300 s; gate holds") no longer holds: it says why it ended.
        db.execute(
            "UPDATE waves SET state = ?, reason = ?, "
            "ended_at = CASE WHEN started_at IS NULL THEN ended_at ELSE COALESCE(ended_at, ?) END "
            "WHERE rollout_id = ? AND state IN (?, ?, ?)",
            (
                WaveState.CANCELLED.value,
                f"cancelled: {why}",
                now,
                rollout_id,
                WaveState.WAITING.value,
                WaveState.RUNNING.value,
                WaveState.SOAKING.value,
            ),
        )

    # -- transitions -------------------------------------------------------------------------------

    def set_state(self, rollout_id: str, state: RolloutState, reason: str = "") -> None:
        """Pause, resume, finish or abort a rollout; ABORTED cancels its unsent devices as well."""
        now = self._clock()
        with self._transaction() as db:
            old = self._rollout_state(db, rollout_id)
            ROLLOUT_MOVES.check(old, state, who=f"rollout {rollout_id}")
            db.execute(
                "UPDATE rollouts SET state = ?, reason = ?, updated_at = ? WHERE id = ?",
                (state.value, reason, now, rollout_id),
            )
            if state is RolloutState.ABORTED:
                self._cancel_unsent(db, rollout_id, now, reason or "the rollout was aborted")
            self._event(db, rollout_id, "rollout", state=state.value, reason=reason)

    def set_wave(
        self,
        rollout_id: str,
        index: int,
        state: WaveState,
        *,
        figures: Mapping[str, Any] | None = None,
        reason: str = "",
    ) -> None:
        """Move wave ``index`` to ``state`` (RUNNING stamps its start, DONE/TRIPPED its end and figures)."""
        now = self._clock()
        with self._transaction() as db:
            row = db.execute(
                "SELECT state FROM waves WHERE rollout_id = ? AND idx = ?", (rollout_id, index)
            ).fetchone()
            if row is None:
                raise RolloutStoreError(f"rollout {rollout_id} has no wave {index}")
            WAVE_MOVES.check(WaveState(row[0]), state, who=f"rollout {rollout_id} wave {index}")
            started = now if state is WaveState.RUNNING else None
            ended = now if WAVE_MOVES[state] == frozenset() else None
            db.execute(
                "UPDATE waves SET state = ?, figures = COALESCE(?, figures), reason = ?, "
                "started_at = COALESCE(started_at, ?), ended_at = COALESCE(ended_at, ?) "
                "WHERE rollout_id = ? AND idx = ?",
                (
                    state.value,
                    None if figures is None else json.dumps(dict(figures), sort_keys=True),
                    reason,
                    started,
                    ended,
                    rollout_id,
                    index,
                ),
            )
            self._event(db, rollout_id, "wave", wave=index, state=state.value, reason=reason)

    def mark_sending(self, rollout_id: str, device: str) -> str:
        """Record that ``device``'s desired state is about to be published; returns its job id.

        Written *before* the publish, so a crash between the two leaves the device SENDING and a
        restart publishes the same desired state again rather than skipping the device.
        """
        return self._move(rollout_id, device, DeviceStep.SENDING)

    def mark_sent(self, rollout_id: str, device: str) -> str:
        """Record that the broker acknowledged ``device``'s desired state; returns its job id."""
        return self._move(rollout_id, device, DeviceStep.SENT)

    def mark_resent(self, rollout_id: str, devices: Iterable[str], why: str) -> None:
        """Count one more publish of the (same) desired state of each of ``devices``, in one transaction.

        For a publish that does not move the device (SENDING counts itself): a restarted controller
        publishing its SENT devices again, a deploy publishing its wave again after the broker came
        back. ``sends`` > 1 is what ``sends.resent`` of the rollout's status counts.
        """
        names = list(devices)
        if not names:
            return
        now = self._clock()
        with self._transaction() as db:
            db.executemany(
                "UPDATE devices SET sends = sends + 1, updated_at = ? WHERE rollout_id = ? AND device = ?",
                [(now, rollout_id, device) for device in names],
            )
            self._event(db, rollout_id, "resent", devices=len(names), why=why)

    def record_job(
        self, rollout_id: str, device: str, end: DeviceEnd, figures: Mapping[str, Any] | None = None
    ) -> None:
        """Store a job status of ``device``: its figures, and, when ``end`` is final, its end (ENDED).

        ``figures`` are merged over the stored ones, key by key: a status that lacks a figure an
        earlier status of the job carried (its shadow figures, say) does not erase it.
        """
        now = self._clock()
        with self._transaction() as db:
            step = self._device_step(db, rollout_id, device)
            final = end is not DeviceEnd.PENDING
            if final:
                DEVICE_MOVES.check(step, DeviceStep.ENDED, who=f"rollout {rollout_id} device {device}")
            elif step in (DeviceStep.ENDED, DeviceStep.CANCELLED):
                return  # a late, out-of-order status of a device that ended: its end stands
            merged = None
            if figures is not None:
                row = db.execute(
                    "SELECT figures FROM devices WHERE rollout_id = ? AND device = ?", (rollout_id, device)
                ).fetchone()
                merged = {**(json.loads(row[0]) if row and row[0] else {}), **figures}
            db.execute(
                "UPDATE devices SET step = ?, end_state = ?, figures = COALESCE(?, figures), "
                "ended_at = ?, updated_at = ? WHERE rollout_id = ? AND device = ?",
                (
                    DeviceStep.ENDED.value if final else step.value,
                    end.value,
                    None if merged is None else json.dumps(merged, sort_keys=True),
                    now if final else None,
                    now,
                    rollout_id,
                    device,
                ),
            )
            if final:
                self._event(db, rollout_id, "device", device=device, end=end.value)

    def _move(self, rollout_id: str, device: str, step: DeviceStep) -> str:
        now = self._clock()
        with self._transaction() as db:
            old = self._device_step(db, rollout_id, device)
            DEVICE_MOVES.check(old, step, who=f"rollout {rollout_id} device {device}")
            db.execute(
                "UPDATE devices SET step = ?, sends = sends + ?, sent_at = COALESCE(?, sent_at), "
                "updated_at = ? WHERE rollout_id = ? AND device = ?",
                (
                    step.value,
                    1 if step is DeviceStep.SENDING else 0,
                    now if step is DeviceStep.SENT else None,
                    now,
                    rollout_id,
                    device,
                ),
            )
            self._event(db, rollout_id, "device", device=device, step=step.value)
            row = db.execute(
                "SELECT job_id FROM devices WHERE rollout_id = ? AND device = ?", (rollout_id, device)
            ).fetchone()
            return str(row[0])

    def _rollout_state(self, db: sqlite3.Connection, rollout_id: str) -> RolloutState:
        row = db.execute("SELECT state FROM rollouts WHERE id = ?", (rollout_id,)).fetchone()
        if row is None:
            raise RolloutNotFoundError(f"no rollout {rollout_id}")
        return RolloutState(row[0])

    def _device_step(self, db: sqlite3.Connection, rollout_id: str, device: str) -> DeviceStep:
        row = db.execute(
            "SELECT step FROM devices WHERE rollout_id = ? AND device = ?", (rollout_id, device)
        ).fetchone()
        if row is None:
            raise RolloutStoreError(f"rollout {rollout_id} has no device {device}")
        return DeviceStep(row[0])

    def note(self, rollout_id: str, what: str, **detail: Any) -> None:
        """Log an event that is no state transition (a rollback planned, an operator's wish)."""
        with self._transaction() as db:
            self._rollout_state(db, rollout_id)
            self._event(db, rollout_id, what, **detail)
