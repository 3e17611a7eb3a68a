"""One device as the fleet view keeps it, within bounds: each message a device sends, taken in and
cut to size.

Everything here is what one device can make the controller keep (docs/console.md, "What the
controller keeps of a device"): the info within :data:`INFO_BYTES`, the latest telemetry within
:data:`MAX_FIGURES` figures whose names are at most :data:`MAX_FIGURE_NAME` characters and
:data:`FIGURE_NAME_CHARS` in all, a chart history of at most :data:`MAX_HISTORY_POINTS` points
(:mod:`agent.fleet.view.chart_history`), :data:`MAX_JOBS` jobs of at most :data:`JOB_BYTES` each
(one of them, BUILDING, with its latest build progress: a phase name and five numbers) and
:data:`~agent.fleet.view.status.MAX_PROBLEMS` problem lines; :data:`DEVICE_BYTES` is what that costs
at most. Not thread-safe: :class:`~agent.fleet.view.live.FleetView` calls these under its lock.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field, replace
from typing import Any

from agent.fleet.base.bounded import fit
from agent.fleet.base.untrusted import clipped
from agent.fleet.view.cameras import camera_summary
from agent.fleet.view.chart_history import ChartHistory
from agent.fleet.view.status import JSON_TEXT_LIMIT, MAX_PROBLEMS, slot_summary
from agent.fleet.view.targets import target_summary
from agent.protocol.messages import (
    BuildProgressInfo,
    InfoMessage,
    JobState,
    JobStatus,
    StatusMessage,
    TelemetryMessage,
)

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
    #: While the job is BUILDING: the latest build progress it sent (a phase name of the protocol's
    #: and numbers: fixed size). None in any other state, and on every other job of the device.
    build: BuildProgressInfo | None = None


@dataclass
class DeviceRecord:
    """What the view keeps of one device (mutable; copied out as a DeviceState)."""

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
    cameras: dict[str, dict[str, Any]] = field(default_factory=dict)
    cert_not_after: float | None = None  # the client certificate's expiry, from up/info
    #: Its configuration and agent release (agent.fleet.view.targets.target_summary), each field capped.
    targets: dict[str, dict[str, Any]] = field(default_factory=dict)
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


def take_message(row: DeviceRecord, message: object, now: float, history_s: float) -> bool:
    """Take one decoded message into ``row``; True when it changed something (a stale Last Will,
    a repeated or older job transition change nothing). Telemetry older than ``history_s`` leaves the
    charts."""
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
        take_info(row, message)
    elif isinstance(message, TelemetryMessage):
        figures = take_figures(row, message)
        row.telemetry, row.telemetry_at = figures, now
        row.history.add(now, figures)
        row.history.drop_before(now - history_s)
    elif isinstance(message, JobStatus):
        return take_job(row, message)
    else:
        return False
    return True


def note(row: DeviceRecord, text: str) -> bool:
    """Add a problem line (once: a device repeating the same fault does not fill the list)."""
    line = clipped(text, JSON_TEXT_LIMIT)
    if len(row.problems) >= MAX_PROBLEMS or line in row.problems:
        return False
    row.problems.append(line)
    return True


def take_figures(row: DeviceRecord, message: TelemetryMessage) -> dict[str, float]:
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
        note(row, f"telemetry: {long_names} figure(s) named with over {MAX_FIGURE_NAME} characters left out")
    if len(figures) + long_names < len(extra):
        note(
            row,
            f"telemetry: {len(extra)} figures; the first {len(figures)} kept "
            f"(at most {MAX_FIGURES}, {FIGURE_NAME_CHARS} characters of names)",
        )
    return figures


def take_info(row: DeviceRecord, info: InfoMessage) -> None:
    """The slots, cameras, labels and platform of ``info``, within INFO_BYTES (slots first: they
    matter most; at most MAX_CAMERAS cameras)."""
    row.agent_version = clipped(info.agent_version, JSON_TEXT_LIMIT)
    kept, cut = fit(
        {
            "slots": slot_summary(info),
            "cameras": camera_summary(info),
            "labels": dict(info.labels),
            "platform": dict(info.platform),
        },
        INFO_BYTES,
        JSON_TEXT_LIMIT,
    )
    row.slots = kept.get("slots", {})
    row.slots_listed = len(info.slots)
    row.cameras = kept.get("cameras", {})
    row.cert_not_after = None if info.certificate is None else info.certificate.not_after
    row.targets = target_summary(info)
    row.labels = kept.get("labels", {})
    row.platform = kept.get("platform", {})
    sizes = (
        (row.slots, info.slots),
        (row.cameras, camera_summary(info)),
        (row.labels, info.labels),
        (row.platform, info.platform),
    )
    if cut and any(len(part) < len(whole) for part, whole in sizes):
        note(row, f"info: over the {INFO_BYTES // 1024} KiB kept per device; the first entries kept")
    # The slots' last jobs (a restarted controller heard no job message yet: up/info names them).
    for name, slot in info.slots.items():
        if name not in row.slots or not slot.last_job or slot.last_job_state is None:
            continue
        end = slot.last_failure if slot.last_failure and slot.last_failure.job_id == slot.last_job else None
        at = end.ts if end is not None else (slot.since if slot.since is not None else info.ts)
        remember(
            row,
            job_seen(
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


def job_seen(
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


def remember(row: DeviceRecord, job: JobSeen) -> bool:
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


def take_job(row: DeviceRecord, job: JobStatus) -> bool:
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
    seen = job_seen(
        job_id=job.job_id,
        slot=job.slot,
        state=job.state.value,
        at=job.ts,
        error_code=job.error_code,
        error=job.error,
        shadow=shadow if shadow is not None else (previous.shadow if previous else None),
        probation=probation if probation is not None else (previous.probation if previous else None),
    )
    if job.state is JobState.BUILDING and job.build is not None:
        # One build kept per device: a device runs one deployment at a time, so another job still
        # marked as building lost its later states (a supersede): its progress is old news.
        for other in [j for j in row.jobs.values() if j.build is not None]:
            row.jobs[other.job_id] = replace(other, build=None)
        seen = replace(seen, build=job.build)
    row.jobs[seen.job_id] = seen
    while len(row.jobs) > MAX_JOBS:
        del row.jobs[next(iter(row.jobs))]
    return True
