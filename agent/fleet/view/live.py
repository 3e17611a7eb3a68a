"""A live, thread-safe picture of the fleet, fed with every message the controller receives.

The controller (and the console, and ``/metrics``) subscribe to :meth:`FleetView.topic_filters` and
hand each message to :meth:`FleetView.apply`. The view keeps, per device, the latest ``up/status``,
``up/info`` and ``up/telemetry``, a bounded history of telemetry for charts, and the latest state of
the last jobs heard on ``up/jobs/{job_id}`` (after a restart, before any is heard: the jobs its
``up/info`` names and :meth:`FleetView.remember_jobs` was given, from the rollout store). Readers
get frozen copies (:class:`DeviceState`), so they never hold the lock while they render.

Decoding is the fleet commands' own: :func:`agent.fleet.view.watch.read_message` checks each payload
against its protocol model and names what was wrong (a malformed message becomes a problem line of
that device, never an exception), and :func:`agent.fleet.view.status.slot_summary` turns ``up/info``
slots into the same dicts ``fleet status --json`` prints. Everything a device sent is untrusted:
strings are cut to :data:`~agent.fleet.view.status.JSON_TEXT_LIMIT` characters (a device can send
megabytes), and whoever renders them escapes them (the console's HTML templates, or
:func:`agent.fleet.base.untrusted.shown` on a terminal). Memory is bounded in count and in bytes
(docs/console.md, "What the controller keeps of a device"): per device, the info within
:data:`INFO_BYTES`, the latest telemetry within :data:`MAX_FIGURES` figures whose names are at most
:data:`MAX_FIGURE_NAME` characters and :data:`FIGURE_NAME_CHARS` in all, a chart history of
``history_s`` seconds and at most :data:`MAX_HISTORY_POINTS` points of four figures each
(:mod:`agent.fleet.view.chart_history`), :data:`MAX_JOBS` jobs of at most :data:`JOB_BYTES` each and
:data:`~agent.fleet.view.status.MAX_PROBLEMS` problem lines.

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

from agent.fleet.base.bounded import fit
from agent.fleet.base.untrusted import clipped
from agent.fleet.view.chart_history import ChartHistory, TelemetryPoint
from agent.fleet.view.status import JSON_TEXT_LIMIT, MAX_PROBLEMS, slot_summary
from agent.fleet.view.watch import read_message
from agent.mqtt.inbound import InboundMessage
from agent.protocol.messages import InfoMessage, JobStatus, StatusMessage, TelemetryMessage
from agent.protocol.topics import fleet_filter, parse

#: Jobs kept per device (the latest state of each), latest first.
MAX_JOBS = 20
#: Estimated bytes (:mod:`agent.fleet.base.bounded`) of one kept job: ids, error text, shadow and
#: probation figures (a real one is under 2 KiB; a hostile ``baseline`` may hold millions of figures).
JOB_BYTES = 8 * 1024
#: Telemetry points kept per device whatever ``history_s`` says (an hour at 1 s, 6 hours at 10 s).
MAX_HISTORY_POINTS = 3600
#: Telemetry figures kept of the latest message (a real one carries ~80 per stream and slot).
MAX_FIGURES = 1000
#: Longest telemetry figure name kept (real ones are under 60, a stream's name inside); a longer
#: figure is left out.
MAX_FIGURE_NAME = 512
#: Characters of figure names kept of the latest message, all names together.
FIGURE_NAME_CHARS = 32 * 1024
#: Estimated bytes of a device's ``up/info`` as kept (slots, labels, platform; a real one is ~6 KiB).
INFO_BYTES = 64 * 1024
#: Longest device id kept: a topic level may be 65,535 bytes; an id longer than this is refused.
MAX_DEVICE_ID = 256
#: What one device can cost the controller at every bound above, at most: 0.37 MB of objects
#: (tracemalloc), 0.37 to 0.40 MB of resident memory with the allocator's share
#: (tests/fleet/base/test_hostile_devices.py measures it on a real controller and fails above this).
DEVICE_BYTES = 640 * 1024
#: Job message ids remembered per device to drop repeats (QoS 1 resends, spool replay).
SEEN_JOB_IDS = 256
#: Characters of a message id kept for that (a real one is 32 hex digits).
MSG_ID_CHARS = 64


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
    slots: dict[str, dict[str, Any]]  # from up/info: see agent.fleet.view.status.slot_summary
    telemetry: dict[str, float]  # the latest up/telemetry figures
    telemetry_at: float | None  # when they arrived (controller clock)
    stale: bool  # offline, or online with no telemetry for stale_after_s
    jobs: tuple[JobSeen, ...]  # latest first, at most MAX_JOBS
    problems: tuple[str, ...]  # malformed messages, named
    slots_listed: int = 0  # slots in the device's up/info, those cut off by INFO_BYTES included


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
    slots_listed: int = 0
    telemetry: dict[str, float] = field(default_factory=dict)
    telemetry_at: float | None = None
    heard_at: float = 0.0  # controller clock: the last message of any kind (eviction, forgetting)
    history: ChartHistory = field(default_factory=lambda: ChartHistory(MAX_HISTORY_POINTS))
    jobs: dict[str, JobSeen] = field(default_factory=dict)  # insertion order = oldest update first
    seen_job_msgs: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=SEEN_JOB_IDS)
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
        self._devices: collections.OrderedDict[str, _Device] = collections.OrderedDict()
        #: Jobs known from elsewhere (the rollout store, after a restart) of devices not heard yet.
        self._remembered: dict[str, list[JobSeen]] = {}
        self._version = 0
        self._swept_at = float("-inf")
        self.refused_devices = 0  # messages from devices refused (the view full, or an id too long)
        self.forgotten_devices = 0  # devices that left the view (cleared, aged out, or evicted)
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
            if seen.problem is not None:
                changed = _note(row, f"{topic.kind}: {seen.problem}")
            else:
                changed = self._take(row, seen.message, now)
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
            _job_seen(
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
                changed = [_remember(row, job) for job in kept]  # every job, not up to the first change
                if any(changed):
                    self._changed(row)
            elif device_id in self._remembered or len(self._remembered) < self.max_devices:
                self._remembered[device_id] = kept

    def _changed(self, row: _Device | None = None, *, described: bool = True) -> None:
        """Count a change of the view; ``row``'s change marks are set (``described`` unless only
        its telemetry figures changed) so that /metrics redoes that device's lines (:meth:`changes`)."""
        self._version += 1
        if row is not None:
            row.changed = self._version
            if described:
                row.described = self._version
        self._cond.notify_all()

    def _admit(self, device_id: str, now: float) -> _Device | None:
        """A new row for ``device_id``, making room when the view is full; None when refused."""
        if len(self._devices) >= self.max_devices:
            oldest = next(iter(self._devices.values()), None)
            if oldest is None or (oldest.state == "online" and now - oldest.heard_at <= self.stale_after_s):
                return None
            del self._devices[oldest.device]
            self.forgotten_devices += 1
        row = self._devices[device_id] = _Device(device_id)
        for job in self._remembered.pop(device_id, []):
            _remember(row, job)
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
            self._changed(row)
            return True

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
            _take_info(row, message)
        elif isinstance(message, TelemetryMessage):
            figures = _figures(row, message)
            row.telemetry, row.telemetry_at = figures, now
            row.history.add(now, figures)
            row.history.drop_before(now - self.history_s)
        elif isinstance(message, JobStatus):
            return _take_job(row, message)
        else:
            return False
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
            slots_listed=row.slots_listed,
        )


def _note(row: _Device, text: str) -> bool:
    """Add a problem line (once: a device repeating the same fault does not fill the list)."""
    line = clipped(text, JSON_TEXT_LIMIT)
    if len(row.problems) >= MAX_PROBLEMS or line in row.problems:
        return False
    row.problems.append(line)
    return True


def _figures(row: _Device, message: TelemetryMessage) -> dict[str, float]:
    """The figures of ``message`` the view keeps: names up to MAX_FIGURE_NAME characters, at most
    MAX_FIGURES of them and FIGURE_NAME_CHARS of names in all, in the message's order."""
    figures: dict[str, float] = {}
    chars = long_names = 0
    extra = message.__pydantic_extra__ or {}
    for name, value in extra.items():
        if len(name) > MAX_FIGURE_NAME:
            long_names += 1
            continue
        if len(figures) >= MAX_FIGURES or chars + len(name) > FIGURE_NAME_CHARS:
            break
        figures[name] = float(value)
        chars += len(name)
    if long_names:
        _note(row, f"telemetry: {long_names} figure(s) named with over {MAX_FIGURE_NAME} characters left out")
    if len(figures) + long_names < len(extra):
        _note(
            row,
            f"telemetry: {len(extra)} figures; the first {len(figures)} kept "
            f"(at most {MAX_FIGURES}, {FIGURE_NAME_CHARS} characters of names)",
        )
    return figures


def _take_info(row: _Device, info: InfoMessage) -> None:
    """The slots, labels and platform of ``info``, within INFO_BYTES (slots first: they matter most)."""
    row.agent_version = clipped(info.agent_version, JSON_TEXT_LIMIT)
    kept, cut = fit(
        {"slots": slot_summary(info), "labels": dict(info.labels), "platform": dict(info.platform)},
        INFO_BYTES,
        JSON_TEXT_LIMIT,
    )
    row.slots = kept.get("slots", {})
    row.slots_listed = len(info.slots)
    row.labels = kept.get("labels", {})
    row.platform = kept.get("platform", {})
    sizes = ((row.slots, info.slots), (row.labels, info.labels), (row.platform, info.platform))
    if cut and any(len(part) < len(whole) for part, whole in sizes):
        _note(row, f"info: over the {INFO_BYTES // 1024} KiB kept per device; the first entries kept")
    # The slots' last jobs (a restarted controller heard no job message yet: up/info names them).
    for name, slot in info.slots.items():
        if name not in row.slots or not slot.last_job or slot.last_job_state is None:
            continue
        end = slot.last_failure if slot.last_failure and slot.last_failure.job_id == slot.last_job else None
        at = end.ts if end is not None else (slot.since if slot.since is not None else info.ts)
        _remember(
            row,
            _job_seen(
                job_id=slot.last_job,
                slot=name,
                state=slot.last_job_state.value,
                at=at,
                error_code=slot.last_job_error_code,
                error=end.error if end is not None else None,
                shadow=None,
                probation=None,
            ),
        )


def _job_seen(
    *,
    job_id: str,
    slot: str,
    state: str,
    at: float,
    error_code: str | None,
    error: str | None,
    shadow: dict[str, Any] | None,
    probation: dict[str, Any] | None,
) -> JobSeen:
    """A JobSeen within JOB_BYTES, every string within JSON_TEXT_LIMIT (ids and text first)."""
    kept, _ = fit(
        {
            "job_id": job_id,
            "slot": slot,
            "state": state,
            "error_code": error_code,
            "error": error,
            "shadow": shadow,
            "probation": probation,
        },
        JOB_BYTES,
        JSON_TEXT_LIMIT,
    )
    return JobSeen(
        job_id=kept.get("job_id", ""),
        slot=kept.get("slot", ""),
        state=kept.get("state", state),
        at=at,
        error_code=kept.get("error_code"),
        error=kept.get("error"),
        shadow=kept.get("shadow"),
        probation=kept.get("probation"),
    )


def _remember(row: _Device, job: JobSeen) -> bool:
    """Take a job known from elsewhere: fill the gaps of the one heard, or add it in time order."""
    known = row.jobs.get(job.job_id)
    if known is not None:
        if (known.shadow or not job.shadow) and (known.probation or not job.probation):
            return False
        row.jobs[job.job_id] = JobSeen(
            job_id=known.job_id,
            slot=known.slot,
            state=known.state,
            at=known.at,
            error_code=known.error_code or job.error_code,
            error=known.error or job.error,
            shadow=known.shadow or job.shadow,
            probation=known.probation or job.probation,
        )
        return True
    if len(row.jobs) >= MAX_JOBS and all(j.at >= job.at for j in row.jobs.values()):
        return False  # older than every job kept: it would be dropped at once
    ordered = sorted([*row.jobs.values(), job], key=lambda j: j.at)[-MAX_JOBS:]
    row.jobs = {j.job_id: j for j in ordered}
    return True


def _take_job(row: _Device, job: JobStatus) -> bool:
    """Record one job transition: the job moves to the front; a repeated ``msg_id`` changes nothing."""
    msg_id = job.msg_id[:MSG_ID_CHARS]
    if msg_id in row.seen_job_msgs:
        return False
    row.seen_job_msgs.append(msg_id)
    job_id = clipped(job.job_id, JSON_TEXT_LIMIT)
    previous = row.jobs.get(job_id)
    if previous is not None and job.ts < previous.at:
        return False  # an older transition arriving late (spool replay): keep the newer one
    row.jobs.pop(job_id, None)  # re-inserted below: the dict's order is the order of the updates
    shadow = job.shadow.model_dump(mode="json") if job.shadow else None
    probation = job.probation.model_dump(mode="json") if job.probation else None
    seen = _job_seen(
        job_id=job.job_id,
        slot=job.slot,
        state=job.state.value,
        at=job.ts,
        error_code=job.error_code,
        error=job.error,
        shadow=shadow if shadow is not None else (previous.shadow if previous else None),
        probation=probation if probation is not None else (previous.probation if previous else None),
    )
    row.jobs[seen.job_id] = seen
    while len(row.jobs) > MAX_JOBS:
        del row.jobs[next(iter(row.jobs))]
    return True
