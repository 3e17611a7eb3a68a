"""A live, thread-safe picture of the fleet, fed with every message the controller receives.

The controller (and the console, and ``/metrics``) subscribe to :meth:`FleetView.topic_filters` and
hand each message to :meth:`FleetView.apply`. The view keeps, per device, the latest ``up/status``,
``up/info`` and ``up/telemetry``, a bounded history of telemetry for charts, and the latest state of
the last jobs heard on ``up/jobs/{job_id}``. Readers get frozen copies (:class:`DeviceState`), so
they never hold the lock while they render.

Decoding is the fleet commands' own: :func:`agent.fleet.watch.read_message` checks each payload
against its protocol model and names what was wrong (a malformed message becomes a problem line of
that device, never an exception), and :func:`agent.fleet.status.slot_summary` turns ``up/info``
slots into the same dicts ``fleet status --json`` prints. Everything a device sent is untrusted:
strings are cut to :data:`~agent.fleet.status.JSON_TEXT_LIMIT` characters (a device can send
megabytes), and whoever renders them escapes them (the console's HTML templates, or
:func:`agent.fleet.untrusted.shown` on a terminal). Memory is bounded: at most ``max_devices``
devices (later ones are counted in :attr:`FleetView.refused_devices`), :data:`MAX_JOBS` jobs, a
telemetry history of ``history_s`` seconds (at most :data:`MAX_HISTORY_POINTS` points) and
:data:`~agent.fleet.status.MAX_PROBLEMS` problem lines per device.

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

from agent.fleet.status import JSON_TEXT_LIMIT, MAX_PROBLEMS, clip_strings, slot_summary
from agent.fleet.untrusted import clipped
from agent.fleet.watch import read_message
from agent.mqtt.inbound import InboundMessage
from agent.protocol.messages import InfoMessage, JobStatus, StatusMessage, TelemetryMessage
from agent.protocol.topics import fleet_filter, parse

#: Jobs kept per device (the latest state of each), latest first.
MAX_JOBS = 20
#: Telemetry points kept per device whatever ``history_s`` says (an hour at 1 s, 6 hours at 10 s).
MAX_HISTORY_POINTS = 3600
#: Telemetry figures kept per message (a real one carries ~80 per stream and slot; a hostile one millions).
MAX_FIGURES = 2000
#: Job message ids remembered per device to drop repeats (QoS 1 resends, spool replay).
_SEEN_JOB_IDS = 256


@dataclass(frozen=True)
class TelemetryPoint:
    """One ``up/telemetry`` sample: when it arrived (controller clock) and its flat numeric figures."""

    ts: float
    figures: dict[str, float]


@dataclass(frozen=True)
class JobSeen:
    """The latest state heard of one job on ``up/jobs/{job_id}``."""

    job_id: str
    slot: str
    state: str
    at: float  # the device's time of that state, Unix seconds
    error_code: str | None
    error: str | None
    shadow: dict[str, Any] | None  # the latest shadow figures the job published (kept across states)
    probation: dict[str, Any] | None


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
    slots: dict[str, dict[str, Any]]  # from up/info: see agent.fleet.status.slot_summary
    telemetry: dict[str, float]  # the latest up/telemetry figures
    telemetry_at: float | None  # when they arrived (controller clock)
    stale: bool  # offline, or online with no telemetry for stale_after_s
    jobs: tuple[JobSeen, ...]  # latest first, at most MAX_JOBS
    problems: tuple[str, ...]  # malformed messages, named


@dataclass
class _Device:
    device: str
    state: str = "unknown"
    since: float | None = None
    session: int | None = None
    agent_version: str | None = None
    online_heard_at: float | None = None  # controller clock: the staleness clock of a silent new device
    labels: dict[str, str] = field(default_factory=dict)
    platform: dict[str, Any] = field(default_factory=dict)
    slots: dict[str, dict[str, Any]] = field(default_factory=dict)
    telemetry: dict[str, float] = field(default_factory=dict)
    telemetry_at: float | None = None
    history: collections.deque[TelemetryPoint] = field(
        default_factory=lambda: collections.deque(maxlen=MAX_HISTORY_POINTS)
    )
    jobs: dict[str, JobSeen] = field(default_factory=dict)  # insertion order = oldest update first
    seen_job_msgs: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=_SEEN_JOB_IDS)
    )
    problems: list[str] = field(default_factory=list)
    changed: int = 0  # the view's version at this device's latest change (see FleetView.changes)
    described: int = 0  # ... at its latest change other than new telemetry figures


class FleetView:
    """The fleet as the controller hears it; every method is safe to call from any thread."""

    def __init__(
        self,
        prefix: str,
        *,
        history_s: float = 3600.0,
        stale_after_s: float = 60.0,
        max_devices: int = 10_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.prefix = prefix
        self.history_s = history_s
        self.stale_after_s = stale_after_s
        self.max_devices = max_devices
        self._clock = clock
        self._devices: dict[str, _Device] = {}
        self._version = 0
        self.refused_devices = 0  # messages from devices past max_devices (not kept)
        self._cond = threading.Condition()

    def topic_filters(self) -> list[str]:
        """What to subscribe to: every device's status, info, telemetry and job states."""
        return [fleet_filter(self.prefix, kind) for kind in ("status", "info", "telemetry", "jobs")]

    def apply(self, message: InboundMessage) -> bool:
        """Take one received message into the view; True when it changed something.

        Never raises on device input: a topic outside the tree or of another kind is ignored, an
        empty payload (a cleared retained topic) too, and a payload that does not parse becomes a
        problem line of that device.
        """
        try:
            topic = parse(message.topic, self.prefix)
        except ValueError:
            return False
        if topic.direction != "up" or topic.kind not in {"status", "info", "telemetry", "jobs"}:
            return False
        if not message.payload:
            return False
        seen = read_message(topic, message.payload, message.retain)
        now = self._clock()
        with self._cond:
            row = self._devices.get(topic.device)
            if row is None:
                if len(self._devices) >= self.max_devices:
                    self.refused_devices += 1
                    return False
                row = self._devices[topic.device] = _Device(topic.device)
            if seen.problem is not None:
                if len(row.problems) >= MAX_PROBLEMS:
                    return False
                row.problems.append(clipped(f"{topic.kind}: {seen.problem}", JSON_TEXT_LIMIT))
                changed = True
            else:
                changed = self._take(row, seen.message, now)
            if changed:
                self._version += 1
                row.changed = self._version
                if topic.kind != "telemetry" or seen.problem is not None:
                    row.described = self._version
                self._cond.notify_all()
            return changed

    def _take(self, row: _Device, message: object, now: float) -> bool:
        if isinstance(message, StatusMessage):
            if (
                message.state == "offline"
                and row.state == "online"
                and row.session is not None
                and message.session < row.session
            ):
                return False  # a stale Last Will of an earlier connection (docs/protocol.md)
            if message.state == "online" and row.state != "online":
                row.online_heard_at = now
            row.state, row.since, row.session = message.state, message.ts, message.session
            row.agent_version = row.agent_version or clipped(message.agent_version, JSON_TEXT_LIMIT)
        elif isinstance(message, InfoMessage):
            row.agent_version = clipped(message.agent_version, JSON_TEXT_LIMIT)
            row.platform = clip_strings(dict(message.platform))
            row.labels = clip_strings(dict(message.labels))
            row.slots = clip_strings(slot_summary(message))
        elif isinstance(message, TelemetryMessage):
            figures = dict(list(message.fields().items())[:MAX_FIGURES])
            row.telemetry, row.telemetry_at = figures, now
            row.history.append(TelemetryPoint(now, figures))
            while row.history and row.history[0].ts < now - self.history_s:
                row.history.popleft()
        elif isinstance(message, JobStatus):
            return _take_job(row, message)
        else:
            return False
        return True

    def devices(self) -> list[DeviceState]:
        """Every device, sorted by id (copies)."""
        now = self._clock()
        with self._cond:
            return [self._state(self._devices[d], now) for d in sorted(self._devices)]

    def device(self, device_id: str) -> DeviceState | None:
        """One device (a copy), or None when nothing was heard from it."""
        now = self._clock()
        with self._cond:
            row = self._devices.get(device_id)
            return None if row is None else self._state(row, now)

    def history(self, device_id: str, since: float | None = None) -> list[TelemetryPoint]:
        """The device's telemetry of the last ``history_s`` seconds (from ``since`` on), oldest first."""
        now = self._clock()
        start = now - self.history_s if since is None else max(since, now - self.history_s)
        with self._cond:
            row = self._devices.get(device_id)
            if row is None:
                return []
            return [p for p in row.history if p.ts >= start]

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

    def _stale(self, row: _Device, now: float) -> bool:
        heard = row.telemetry_at if row.telemetry_at is not None else row.online_heard_at
        return row.state != "online" or heard is None or now - heard > self.stale_after_s

    def _state(self, row: _Device, now: float) -> DeviceState:
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
        )


def _take_job(row: _Device, job: JobStatus) -> bool:
    """Record one job transition: the job moves to the front; a repeated ``msg_id`` changes nothing."""
    if job.msg_id in row.seen_job_msgs:
        return False
    row.seen_job_msgs.append(job.msg_id)
    job_id = clipped(job.job_id, JSON_TEXT_LIMIT)
    previous = row.jobs.get(job_id)
    if previous is not None and job.ts < previous.at:
        return False  # an older transition arriving late (spool replay): keep the newer one
    row.jobs.pop(job_id, None)  # re-inserted below: the dict's order is the order of the updates
    shadow = clip_strings(job.shadow.model_dump(mode="json")) if job.shadow else None
    probation = clip_strings(job.probation.model_dump(mode="json")) if job.probation else None
    row.jobs[job_id] = JobSeen(
        job_id=job_id,
        slot=clipped(job.slot, JSON_TEXT_LIMIT),
        state=job.state.value,
        at=job.ts,
        error_code=clipped(job.error_code, JSON_TEXT_LIMIT) if job.error_code else None,
        error=clipped(job.error, JSON_TEXT_LIMIT) if job.error else None,
        shadow=shadow if shadow is not None else (previous.shadow if previous else None),
        probation=probation if probation is not None else (previous.probation if previous else None),
    )
    while len(row.jobs) > MAX_JOBS:
        del row.jobs[next(iter(row.jobs))]
    return True
