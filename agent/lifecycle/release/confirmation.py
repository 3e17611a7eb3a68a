"""The new release on trial: confirmed once healthy for a whole window, put back when its time runs out.

Runs in the candidate itself from start-up, independent of the job (which resumes only once the agent
is connected): it counts the start as reached, then reads the health each ``poll_s``. Healthy without a
break for ``confirm_s`` (longer than a crash that comes only after a while: 60 s by default, a release
that crash-loops after 30 s is never confirmed) makes the candidate the good release. When the deadline
passes first, the previous release is made current again with the last reason it was unhealthy, and
the agent restarts into it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from agent.lifecycle.health import HealthReading, unhealthy_because
from agent.lifecycle.release.layout import (
    CONFIRMING,
    REVERTING,
    WATCHING,
    PendingUpdate,
    Releases,
    stop_point,
)


def reading_record(reading: HealthReading) -> dict[str, object]:
    """``reading`` as update.json keeps it."""
    return {
        "connected": reading.connected,
        "streams_flowing": sorted(reading.streams_flowing),
        "streams": sorted(reading.streams),
        "slots_failing": sorted(reading.slots_failing),
    }


def reading_from(record: dict[str, object]) -> HealthReading:
    def names(key: str) -> frozenset[str]:
        value = record.get(key, [])
        return frozenset(str(item) for item in value) if isinstance(value, list) else frozenset()

    return HealthReading(
        connected=bool(record.get("connected", True)),
        streams_flowing=names("streams_flowing"),
        streams=names("streams"),
        slots_failing=names("slots_failing"),
    )


class Confirmation:
    """Watches the running candidate of a pending update; at most one per process."""

    def __init__(
        self,
        releases: Releases,
        running: str | None,
        health: Callable[[], HealthReading],
        restart: Callable[[], None],
        *,
        poll_s: float,
    ) -> None:
        self._releases = releases
        self._running = running
        self._health = health
        self._restart = restart
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        #: Set once the watch ended (confirmed, or put back and restarting).
        self.ended = threading.Event()

    def start(self) -> bool:
        """Start watching if this process is the candidate of a pending update; counts the start."""
        with self._lock:
            if self._thread is not None:
                return True
            update = self._releases.read_update()
            if update is None or update.state != WATCHING or update.candidate != self._running:
                return False
            update.started += 1
            self._releases.write_update(update)
            stop_point("start-counted")
            self._thread = threading.Thread(
                target=self._watch, args=(update,), name="release-confirmation", daemon=True
            )
            self._thread.start()
            return True

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._poll_s + 5.0)

    def _watch(self, update: PendingUpdate) -> None:
        before = reading_from(update.before)
        healthy_since: float | None = None
        last_reason = "no health reading yet"
        while not self._stop.is_set():
            reason = unhealthy_because(before, self._health())
            now = time.monotonic()
            if reason is None:
                healthy_since = now if healthy_since is None else healthy_since
                if now - healthy_since >= update.confirm_s:
                    self._confirm(update)
                    return
            else:
                healthy_since, last_reason = None, reason
            if time.time() >= update.deadline:
                if healthy_since is not None:
                    last_reason = (
                        f"healthy for {now - healthy_since:.0f} s of the {update.confirm_s:g} s needed"
                    )
                self._revert(update, f"not confirmed within {update.deadline_s:g} s: {last_reason}")
                return
            self._stop.wait(self._poll_s)

    def _confirm(self, update: PendingUpdate) -> None:
        update.state = CONFIRMING
        self._releases.write_update(update)
        stop_point("confirm-recorded")
        self._releases.finish_confirm(update)
        self.ended.set()

    def _revert(self, update: PendingUpdate, reason: str) -> None:
        update.state, update.reason = REVERTING, reason
        self._releases.write_update(update)
        stop_point("revert-recorded")
        self._releases.finish_revert(update)
        self.ended.set()
        self._restart()
