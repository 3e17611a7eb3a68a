"""The console's live updates: server-sent events driven by :attr:`FleetView.version` and the store.

Built for a fleet of thousands: one :class:`Feed` per app computes the device copies once per view
version (not once per browser), each browser's stream then sends only the rows that changed since
its last frame (``upsert``) and the ids that left its filter (``remove``), and no stream sends more
than one frame per ``interval_s``. A quiet fleet costs a comparison per second; a busy one a frame
per second with the devices that moved.

Events (``text/event-stream``; each ``data:`` line is JSON)::

    event: devices    data: {"full": true|false, "upsert": [ROW...], "remove": [ID...], "total": N}
    event: rollouts   data: {"rollouts": [SUMMARY...]}

``full`` marks the first frame of a stream (everything the filter lists); ROW is
:func:`~agent.fleet.console.summary.device_row`, SUMMARY
:func:`~agent.fleet.console.rollouts.rollout_summary`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread

from agent.fleet.console.rollouts import rollout_ids, rollout_summary
from agent.fleet.console.summary import DeviceFilter, device_rows
from agent.fleet.rollout.building import Waits
from agent.fleet.rollout.store import RolloutStore
from agent.fleet.view.live import DeviceState, FleetView

#: Comment lines sent when nothing changed this long, so proxies keep the stream open.
KEEPALIVE_S = 15.0


class Feed:
    """What every stream reads: device copies per view version, rollout summaries per interval.

    ``refresh_s``: device copies are also recomputed this often when the version did not move,
    because staleness (online but silent) follows the clock, not a message.
    """

    def __init__(
        self,
        view: FleetView,
        store: RolloutStore,
        *,
        interval_s: float = 1.0,
        refresh_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        waits: Callable[[], Waits] | None = None,
    ) -> None:
        self.view, self.store = view, store
        #: The devices waiting for another device's build (the controller's build claims), if known.
        self.waits = waits
        self.interval_s, self.refresh_s = interval_s, refresh_s
        self._clock = clock
        self._lock = threading.Lock()
        self._devices: tuple[int, float, list[DeviceState]] = (-1, float("-inf"), [])
        self._rollouts: tuple[float, list[dict[str, Any]]] = (float("-inf"), [])

    def devices(self) -> list[DeviceState]:
        """The fleet's devices (copies), recomputed only when the view changed or ``refresh_s`` passed."""
        version, now = self.view.version, self._clock()
        with self._lock:
            seen, at, devices = self._devices
            if version == seen and now - at < self.refresh_s:
                return devices
        devices = self.view.devices()
        with self._lock:
            self._devices = (version, now, devices)
        return devices

    def rollouts(self) -> list[dict[str, Any]]:
        """Summaries of the listed rollouts, read from the store at most once per ``interval_s``."""
        now = self._clock()
        with self._lock:
            at, summaries = self._rollouts
            if now - at < self.interval_s:
                return summaries
        builds = self.view.builds()  # the engine builds running now (in memory, never in the store)
        waits = self.waits() if self.waits is not None else None
        summaries = [
            rollout_summary(self.store, r, builds=builds, waits=waits) for r in rollout_ids(self.store)
        ]
        with self._lock:
            self._rollouts = (now, summaries)
        return summaries


def _event(name: str, data: Any) -> str:
    # json.dumps escapes every control character: a device string cannot end the data line early.
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


@dataclass
class Stream:
    """One browser's stream: what it asked for, and what it was last sent (to send differences)."""

    feed: Feed
    where: DeviceFilter
    device: str | None = None  # only this device (the device page)
    want_devices: bool = True
    want_rollouts: bool = False
    sent_rows: dict[str, dict[str, Any]] | None = None
    sent_rollouts: list[dict[str, Any]] | None = None
    version: int = -1
    last_sent: float = field(default_factory=time.monotonic)

    def frame(self) -> str:
        """The events that bring the browser up to date ('' when nothing changed since the last)."""
        out = []
        if self.want_devices:
            devices = self.feed.devices()
            if self.device is not None:
                devices = [d for d in devices if d.device == self.device]
            rows = device_rows(devices, self.where)
            previous = self.sent_rows
            if previous is None or rows != previous:
                upsert = [r for i, r in rows.items() if previous is None or previous.get(i) != r]
                remove = [] if previous is None else [i for i in previous if i not in rows]
                out.append(
                    _event(
                        "devices",
                        {"full": previous is None, "upsert": upsert, "remove": remove, "total": len(rows)},
                    )
                )
                self.sent_rows = rows
        if self.want_rollouts:
            summaries = self.feed.rollouts()
            if summaries != self.sent_rollouts:
                out.append(_event("rollouts", {"rollouts": summaries}))
                self.sent_rollouts = summaries
        return "".join(out)

    async def run(
        self, closing: threading.Event, disconnected: Callable[[], Awaitable[bool]]
    ) -> AsyncIterator[str]:
        """The stream's text: a frame when something changed, at most one per ``interval_s``."""
        yield "retry: 2000\n\n"
        interval = self.feed.interval_s
        while not closing.is_set() and not await disconnected():
            text = await anyio.to_thread.run_sync(self.frame)
            now = time.monotonic()
            if text:
                self.last_sent = now
                yield text
            elif now - self.last_sent > KEEPALIVE_S:
                self.last_sent = now
                yield ": keepalive\n\n"
            # Pace first (one frame per interval at most), then wait for the view to move (or the
            # interval to pass: rollouts and staleness change without a view version).
            await anyio.sleep(max(0.0, self.last_sent + interval - time.monotonic()) if text else 0.0)
            self.version = await anyio.to_thread.run_sync(
                self.feed.view.wait_change, self.version, interval, abandon_on_cancel=True
            )
