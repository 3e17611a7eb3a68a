"""The rollout store's queries: a rollout, its waves and devices, counts for ``/metrics``, its log,
where a restarted controller resumes it, and a consistency check. Each reads under the file's lock."""

from __future__ import annotations

import json
from typing import Any

from agent.fleet.rollout.gate import DeviceEnd
from agent.fleet.rollout.records import (
    OPEN_STATES,
    DeviceRow,
    DeviceStep,
    ResumePoint,
    RolloutRow,
    RolloutState,
    WaveRow,
    WaveState,
)
from agent.fleet.rollout.store_file import RolloutNotFoundError, StoreFile


class StoreReads(StoreFile):
    """What the rollout store answers (:class:`~agent.fleet.rollout.store.RolloutStore` adds the writes)."""

    def rollout(self, rollout_id: str) -> RolloutRow:
        """One rollout; :class:`RolloutStoreError` when there is none with this id."""
        with self._reading():
            row = self._db.execute(
                "SELECT id, slot, job_id, to_version, state, spec, reason, created_at, updated_at "
                "FROM rollouts WHERE id = ?",
                (rollout_id,),
            ).fetchone()
        if row is None:
            raise RolloutNotFoundError(f"no rollout {rollout_id}")
        return RolloutRow(row[0], row[1], row[2], row[3], RolloutState(row[4]), json.loads(row[5]), *row[6:])

    def open_rollouts(self) -> list[str]:
        """Ids of the running and paused rollouts, oldest first (what a restarted controller resumes)."""
        with self._reading():
            rows = self._db.execute(
                "SELECT id FROM rollouts WHERE state IN (?, ?) ORDER BY created_at, id", OPEN_STATES
            ).fetchall()
        return [str(row[0]) for row in rows]

    def devices(self, rollout_id: str, wave: int | None = None) -> list[DeviceRow]:
        """The rollout's devices (of one wave when ``wave`` is given), in wave and selection order."""
        query = (
            "SELECT device, wave, from_version, to_version, job_id, step, end_state, figures, sends, "
            "sent_at, ended_at FROM devices WHERE rollout_id = ?"
        )
        params: tuple[Any, ...] = (rollout_id,)
        if wave is not None:
            query += " AND wave = ?"
            params = (rollout_id, wave)
        with self._reading():
            rows = self._db.execute(query + " ORDER BY wave, rowid", params).fetchall()
        return [
            DeviceRow(
                r[0],
                r[1],
                r[2],
                r[3],
                r[4],
                DeviceStep(r[5]),
                None if r[6] is None else DeviceEnd(r[6]),
                None if r[7] is None else json.loads(r[7]),
                r[8],
                r[9],
                r[10],
            )
            for r in rows
        ]

    def device_counts(self, rollout_id: str) -> list[tuple[int, str, str, int]]:
        """How many of the rollout's devices are at each (wave, step, end or ""), counted by SQLite:
        ``/metrics`` reads it at every scrape, where :meth:`devices` of a 10,000-device rollout costs
        ~10x as much."""
        with self._lock:
            rows = self._db.execute(
                "SELECT wave, step, COALESCE(end_state, ''), COUNT(*) FROM devices WHERE rollout_id = ? "
                "GROUP BY wave, step, end_state ORDER BY wave, step, end_state",
                (rollout_id,),
            ).fetchall()
        return [(int(r[0]), str(r[1]), str(r[2]), int(r[3])) for r in rows]

    def last_change(self, rollout_id: str) -> float | None:
        """When anything of the rollout last moved (Unix seconds): a device's step, end or job state, a
        wave's start or end, the rollout's state; ``/metrics`` exports it (a stalled rollout's stops)."""
        with self._lock:
            row = self._db.execute(
                "SELECT MAX(t) FROM ("
                "SELECT MAX(updated_at) AS t FROM devices WHERE rollout_id = ? "
                "UNION ALL SELECT MAX(MAX(COALESCE(started_at, 0), COALESCE(ended_at, 0))) FROM waves "
                "WHERE rollout_id = ? UNION ALL SELECT updated_at FROM rollouts WHERE id = ?)",
                (rollout_id, rollout_id, rollout_id),
            ).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def change_mark(self) -> tuple[int, int]:
        """Moves whenever the store's content may have changed, written through this store or another
        connection to its file; a reader that keeps what it read (``/metrics``) reads again then."""
        with self._lock:
            version = self._db.execute("PRAGMA data_version").fetchone()[0]
            return int(version), self._db.total_changes

    def waves(self, rollout_id: str) -> list[tuple[WaveState, dict[str, Any] | None, str]]:
        """Each wave's state, gate figures and reason, in order."""
        with self._reading():
            rows = self._db.execute(
                "SELECT state, figures, reason FROM waves WHERE rollout_id = ? ORDER BY idx", (rollout_id,)
            ).fetchall()
        return [(WaveState(r[0]), None if r[1] is None else json.loads(r[1]), r[2]) for r in rows]

    def wave_rows(self, rollout_id: str) -> list[WaveRow]:
        """Each wave with its times (the runner's timeout and soak count from ``started_at``)."""
        with self._reading():
            rows = self._db.execute(
                "SELECT idx, state, figures, reason, started_at, ended_at FROM waves WHERE rollout_id = ? "
                "ORDER BY idx",
                (rollout_id,),
            ).fetchall()
        return [
            WaveRow(int(r[0]), WaveState(r[1]), None if r[2] is None else json.loads(r[2]), r[3], r[4], r[5])
            for r in rows
        ]

    def rollouts(self, limit: int = 100) -> list[RolloutRow]:
        """The newest ``limit`` rollouts, newest first."""
        with self._reading():
            ids = self._db.execute(
                "SELECT id FROM rollouts ORDER BY created_at DESC, id DESC LIMIT ?", (limit,)
            ).fetchall()
        return [self.rollout(str(r[0])) for r in ids]

    def events(self, rollout_id: str) -> list[tuple[str, dict[str, Any]]]:
        """The rollout's transitions in the order they were committed."""
        with self._reading():
            rows = self._db.execute(
                "SELECT what, detail FROM events WHERE rollout_id = ? ORDER BY id", (rollout_id,)
            ).fetchall()
        return [(str(r[0]), json.loads(r[1])) for r in rows]

    def resume(self, rollout_id: str) -> ResumePoint:
        """Where a restarted controller picks ``rollout_id`` up (see the module docstring)."""
        rollout = self.rollout(rollout_id)
        with self._reading():
            current = self._db.execute(
                "SELECT idx, state FROM waves WHERE rollout_id = ? AND state IN (?, ?) ORDER BY idx LIMIT 1",
                (rollout_id, WaveState.RUNNING.value, WaveState.SOAKING.value),
            ).fetchone()
        if current is None:
            return ResumePoint(rollout_id, rollout.state, None, None, (), (), (), ())
        by_step: dict[DeviceStep, list[str]] = {step: [] for step in DeviceStep}
        for row in self.devices(rollout_id, wave=int(current[0])):
            by_step[row.step].append(row.device)
        return ResumePoint(
            rollout_id,
            rollout.state,
            int(current[0]),
            WaveState(current[1]),
            tuple(by_step[DeviceStep.PLANNED]),
            tuple(by_step[DeviceStep.SENDING]),
            tuple(by_step[DeviceStep.SENT]),
            tuple(by_step[DeviceStep.ENDED]),
        )

    def check(self) -> list[str]:
        """Problems with the file's consistency (``PRAGMA integrity_check`` and the store's invariants)."""
        problems: list[str] = []
        with self._reading():
            integrity = [str(r[0]) for r in self._db.execute("PRAGMA integrity_check").fetchall()]
            if integrity != ["ok"]:
                problems.extend(integrity)
            for device, step, sent_at, end in self._db.execute(
                "SELECT device, step, sent_at, end_state FROM devices"
            ).fetchall():
                if step == DeviceStep.SENT.value and sent_at is None:
                    problems.append(f"{device}: SENT without sent_at")
                if step == DeviceStep.ENDED.value and end in (None, DeviceEnd.PENDING.value):
                    problems.append(f"{device}: ENDED without an end")
        return problems
