"""A live, thread-safe picture of the fleet, fed with every message the controller receives.

The controller (and the console, and ``/metrics``) subscribe to :meth:`FleetView.topic_filters` and
hand each message to :meth:`FleetView.apply`. The view keeps, per device, the latest ``up/status``,
``up/info`` and ``up/telemetry``, a bounded history of telemetry for charts, and the latest state of
the last jobs heard on ``up/jobs/{job_id}`` (after a restart, before any is heard: the jobs its
``up/info`` names and :meth:`FleetView.remember_jobs` was given, from the rollout store), with the
latest build progress of a BUILDING job (:meth:`FleetView.builds`; one per device). Readers
get frozen copies (:class:`DeviceState`), so they never hold the lock while they render.

Decoding is the fleet commands' own: :func:`agent.fleet.view.watch.read_message` checks each payload
against its protocol model and names what was wrong (a malformed message becomes a problem line of
that device, never an exception), and :func:`agent.fleet.view.status.slot_summary` turns ``up/info``
slots into the same dicts ``fleet status --json`` prints. Everything a device sent is untrusted:
strings are cut to :data:`~agent.fleet.view.status.JSON_TEXT_LIMIT` characters (a device can send
megabytes), and whoever renders them escapes them (the console's HTML templates, or
:func:`agent.fleet.base.untrusted.shown` on a terminal). Memory is bounded in count and in bytes
(docs/console.md, "What the controller keeps of a device"): per device by
:mod:`agent.fleet.view.device_record` (the info, the latest telemetry, a chart history of
``history_s`` seconds, the jobs and problem lines, each within its bound), and in devices by
``max_devices``.

Devices come and go: at most ``max_devices`` are kept. A device whose retained status is cleared
(an empty retained payload: ``fleet decommission``, or an operator's ``mosquitto_pub -r -n``)
leaves the view, and so does one that is not online and was not heard for ``forget_after_s``. When
the view is full, a new device takes the place of the device heard from longest ago, unless that
one is online and was heard within ``stale_after_s``; then the new one is refused and counted in
:attr:`FleetView.refused_devices`. So junk ids sprayed by one client cannot keep a real device
out for longer than ``stale_after_s``, and cannot push out a device that is online and talking.

Times: ``since`` is the device's own time of its status; ``telemetry_at``, the history's ``ts``
and staleness use the controller's clock when the message arrived, so a device with a wrong clock
neither hides nor fakes a silence.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agent.fleet.view.chart_history import TelemetryPoint
from agent.fleet.view.device_record import (
    MAX_JOBS,
    DeviceRecord,
    JobSeen,
    job_seen,
    note,
    remember,
    take_message,
)
from agent.fleet.view.watch import read_message
from agent.mqtt.inbound import InboundMessage
from agent.protocol.messages import BuildProgressInfo
from agent.protocol.topics import fleet_filter, parse

#: Longest device id kept: a topic level may be 65,535 bytes; an id longer than this is refused.
MAX_DEVICE_ID = 256


@dataclass(frozen=True)
class DeviceState:
    """What the fleet view knows about one device (a copy: safe to keep and read without a lock)."""

    device: str
    state: str  # online | offline | unknown (no status heard yet)
    since: float | None  # of that status, the device's time
    session: int | None
    agent_version: str | None
    labels: dict[str, str]
    platform: dict[str, Any]
    slots: dict[str, dict[str, Any]]  # from up/info: see agent.fleet.view.status.slot_summary
    telemetry: dict[str, float]  # the latest up/telemetry figures
    telemetry_at: float | None  # when they arrived (controller clock)
    stale: bool  # offline, or online with no telemetry for stale_after_s
    jobs: tuple[JobSeen, ...]  # latest first, at most MAX_JOBS
    problems: tuple[str, ...]  # malformed messages, named
    slots_listed: int = 0  # slots in the device's up/info, those cut off by INFO_BYTES included
    #: Its cameras from up/info (agent.fleet.view.cameras.camera_summary), within INFO_BYTES.
    cameras: dict[str, dict[str, Any]] = field(default_factory=dict)
    cert_not_after: float | None = None  # the client certificate's expiry (up/info), Unix seconds
    #: Its configuration and agent release from up/info (agent.fleet.view.targets.target_summary).
    targets: dict[str, dict[str, Any]] = field(default_factory=dict)


class FleetView:
    """The fleet as the controller hears it; every method is safe to call from any thread."""

    def __init__(
        self,
        prefix: str,
        *,
        history_s: float = 3600.0,
        stale_after_s: float = 60.0,
        max_devices: int = 10_000,
        forget_after_s: float = 7 * 86400.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.prefix = prefix
        self.history_s = history_s
        self.stale_after_s = stale_after_s
        self.max_devices = max_devices
        self.forget_after_s = forget_after_s
        self._clock = clock
        #: When this view started: the charts hold nothing older (a restarted controller's charts
        #: start again; the console says since when).
        self.started_at = clock()
        # Ordered by the last message heard (the least recently heard first): eviction and forgetting
        # look at the front only.
        self._devices: collections.OrderedDict[str, DeviceRecord] = collections.OrderedDict()
        #: Jobs known from elsewhere (the rollout store, after a restart) of devices not heard yet.
        self._remembered: dict[str, list[JobSeen]] = {}
        self._version = 0
        self._swept_at = float("-inf")
        self.refused_devices = 0  # messages from devices refused (the view full, or an id too long)
        self.forgotten_devices = 0  # devices that left the view (cleared, aged out, or evicted)
        self.telemetry_taken = 0  # up/telemetry messages of devices in the view, malformed ones too
        self._cond = threading.Condition()

    def topic_filters(self) -> list[str]:
        """What to subscribe to: every device's status, info, telemetry and job states."""
        return [fleet_filter(self.prefix, kind) for kind in ("status", "info", "telemetry", "jobs")]

    def apply(self, message: InboundMessage) -> bool:
        """Take one received message into the view; True when it changed something.

        Never raises on device input: a topic outside the tree or of another kind is ignored, and a
        payload that does not parse becomes a problem line of that device. An empty payload (a
        cleared retained topic) on ``up/status`` forgets the device; on ``up/info`` it forgets what
        the info said.
        """
        try:
            topic = parse(message.topic, self.prefix)
        except ValueError:
            return False
        if topic.direction != "up" or topic.kind not in {"status", "info", "telemetry", "jobs"}:
            return False
        if len(topic.device) > MAX_DEVICE_ID:
            with self._cond:
                self.refused_devices += 1
            return False
        if not message.payload:
            if topic.kind == "status":
                return self.forget(topic.device)
            if topic.kind == "info":
                return self._clear_info(topic.device)
            return False
        seen = read_message(topic, message.payload, message.retain)
        now = self._clock()
        with self._cond:
            self._sweep(now)
            row = self._devices.get(topic.device)
            if row is None:
                row = self._admit(topic.device, now)
                if row is None:
                    self.refused_devices += 1
                    return False
            row.heard_at = now
            self._devices.move_to_end(topic.device)
            if topic.kind == "telemetry":
                self.telemetry_taken += 1
            if seen.problem is not None:
                changed = note(row, f"{topic.kind}: {seen.problem}")
            else:
                changed = take_message(row, seen.message, now, self.history_s)
            if changed:
                self._changed(row, described=topic.kind != "telemetry" or seen.problem is not None)
            return changed

    def forget(self, device_id: str) -> bool:
        """Drop everything known of ``device_id`` (its retained status was cleared, or an operator
        decommissioned it); False when it was not in the view."""
        with self._cond:
            self._remembered.pop(device_id, None)
            if self._devices.pop(device_id, None) is None:
                return False
            self.forgotten_devices += 1
            self._changed()
            return True

    def remember_jobs(self, device_id: str, jobs: list[JobSeen]) -> None:
        """Jobs of ``device_id`` known from elsewhere (the rollout store, after a restart).

        They fill gaps only: a job the device itself reported keeps its state, and gets the
        remembered shadow and probation figures only where it has none. For a device not heard yet
        they wait (at most ``max_devices`` devices, :data:`MAX_JOBS` jobs each) until it is.
        """
        kept = [  # within JOB_BYTES each: the store's figures came from the device too
            job_seen(
                job_id=j.job_id,
                slot=j.slot,
                state=j.state,
                at=j.at,
                error_code=j.error_code,
                error=j.error,
                shadow=j.shadow,
                probation=j.probation,
            )
            for j in jobs[:MAX_JOBS]
        ]
        with self._cond:
            row = self._devices.get(device_id)
            if row is not None:
                changed = [remember(row, job) for job in kept]  # every job, not up to the first change
                if any(changed):
                    self._changed(row)
            elif device_id in self._remembered or len(self._remembered) < self.max_devices:
                self._remembered[device_id] = kept

    def _changed(self, row: DeviceRecord | None = None, *, described: bool = True) -> None:
        """Count a change of the view; ``row``'s change marks are set (``described`` unless only
        its telemetry figures changed) so that /metrics redoes that device's lines (:meth:`changes`)."""
        self._version += 1
        if row is not None:
            row.changed = self._version
            if described:
                row.described = self._version
        self._cond.notify_all()

    def _admit(self, device_id: str, now: float) -> DeviceRecord | None:
        """A new row for ``device_id``, making room when the view is full; None when refused."""
        if len(self._devices) >= self.max_devices:
            oldest = next(iter(self._devices.values()), None)
            if oldest is None or (oldest.state == "online" and now - oldest.heard_at <= self.stale_after_s):
                return None
            del self._devices[oldest.device]
            self.forgotten_devices += 1
        row = self._devices[device_id] = DeviceRecord(device_id)
        for job in self._remembered.pop(device_id, []):
            remember(row, job)
        return row

    def _sweep(self, now: float) -> None:
        """Forget the devices not online and not heard for ``forget_after_s`` (at most once a minute)."""
        if now - self._swept_at < min(60.0, self.forget_after_s / 4):
            return
        self._swept_at = now
        cutoff = now - self.forget_after_s
        for row in list(self._devices.values()):
            if row.heard_at >= cutoff:
                break  # ordered by heard_at: the rest were heard later
            if row.state != "online":
                del self._devices[row.device]
                self.forgotten_devices += 1
                self._changed()

    def _clear_info(self, device_id: str) -> bool:
        with self._cond:
            row = self._devices.get(device_id)
            if row is None or not (row.labels or row.platform or row.slots):
                return False
            row.labels, row.platform, row.slots, row.slots_listed = {}, {}, {}, 0
            row.cameras, row.targets = {}, {}
            self._changed(row)
            return True

    def devices(self) -> list[DeviceState]:
        """Every device, sorted by id (copies)."""
        now = self._clock()
        with self._cond:
            self._sweep(now)
            return [self._state(self._devices[d], now) for d in sorted(self._devices)]

    def device(self, device_id: str) -> DeviceState | None:
        """One device (a copy), or None when nothing was heard from it."""
        now = self._clock()
        with self._cond:
            row = self._devices.get(device_id)
            return None if row is None else self._state(row, now)

    def builds(self) -> dict[tuple[str, str], BuildProgressInfo]:
        """The latest build progress of every job BUILDING now, by ``(device, job_id)``.

        At most one per device (:func:`~agent.fleet.view.device_record.take_job`), kept in memory
        only: a restarted controller knows none until the device's next progress (within 2 s). A
        device that is not online shows none: its build ended with its connection."""
        with self._cond:
            return {
                (device, job.job_id): job.build
                for device, row in self._devices.items()
                if row.state == "online"
                for job in row.jobs.values()
                if job.build is not None
            }

    def history(self, device_id: str, since: float | None = None) -> list[TelemetryPoint]:
        """The device's telemetry of the last ``history_s`` seconds (from ``since`` on), oldest first."""
        now = self._clock()
        start = now - self.history_s if since is None else max(since, now - self.history_s)
        with self._cond:
            row = self._devices.get(device_id)
            if row is None:
                return []
            return row.history.points(start)

    def history_since(self) -> float:
        """Since when the charts can hold data: ``history_s`` ago, or this view's start if later."""
        return max(self.started_at, self._clock() - self.history_s)

    @property
    def version(self) -> int:
        """Bumps on every change (for server-sent events: send when it moved)."""
        with self._cond:
            return self._version

    def wait_change(self, version: int, timeout: float) -> int:
        """Block until :attr:`version` differs from ``version`` (or ``timeout`` seconds); the version now."""
        with self._cond:
            self._cond.wait_for(lambda: self._version != version, timeout)
            return self._version

    def changes(self) -> dict[str, tuple[int, int, bool]]:
        """Per device: the :attr:`version` of its latest change, of its latest change other than new
        telemetry figures, and whether it is stale now.

        Cheap (no copies), so a reader that keeps something per device (``/metrics`` keeps each
        device's rendered series) asks :meth:`device` only for the devices whose second or third
        item moved, and :meth:`telemetry` for those where only the first did.
        """
        now = self._clock()
        with self._cond:
            return {
                d: (row.changed, row.described, self._stale(row, now)) for d, row in self._devices.items()
            }

    def telemetry(self, device_id: str) -> tuple[dict[str, float], float | None] | None:
        """The device's latest telemetry figures (a copy) and when they arrived; None: not heard."""
        with self._cond:
            row = self._devices.get(device_id)
            return None if row is None else (dict(row.telemetry), row.telemetry_at)

    def _stale(self, row: DeviceRecord, now: float) -> bool:
        heard = row.telemetry_at if row.telemetry_at is not None else row.online_heard_at
        return row.state != "online" or heard is None or now - heard > self.stale_after_s

    def _state(self, row: DeviceRecord, now: float) -> DeviceState:
        stale = self._stale(row, now)
        return DeviceState(
            device=row.device,
            state=row.state,
            since=row.since,
            session=row.session,
            agent_version=row.agent_version,
            labels=dict(row.labels),
            platform=dict(row.platform),
            slots={name: dict(slot) for name, slot in row.slots.items()},
            telemetry=dict(row.telemetry),
            telemetry_at=row.telemetry_at,
            stale=stale,
            jobs=tuple(reversed(row.jobs.values())),
            problems=tuple(row.problems),
            slots_listed=row.slots_listed,
            cameras={name: dict(camera) for name, camera in row.cameras.items()},
            cert_not_after=row.cert_not_after,
            targets={name: dict(target) for name, target in row.targets.items()},
        )
