"""``fleet status``: every device's retained ``up/status`` and ``up/info`` as a table (or JSON), with
each online device's latest ``up/telemetry`` figures (fps, CPU, temperature).

Retained messages arrive right after the subscription; there is no end marker, so collection stops
after a short quiet period once every online device's info is in (or after a bounded total wait: a
large info on a loaded host may come after a pause). Telemetry is not retained: it comes every
``telemetry.interval_s`` (10 s by default), so the command then listens up to ``telemetry_wait_s``
for one message from each online device, and stops as soon as every one has sent one.

Each slot's last job and its end state, and its last failure, come from ``up/info`` (the device
republishes it whenever a job ends, a refused manifest included).

Everything in a row except the operator's own words came from a device: the table passes each cell
through :func:`~agent.fleet.base.untrusted.shown` (escapes, length cap), ``--json`` through
:meth:`DeviceRow.as_dict` (length cap; the JSON encoder escapes control characters), and a device
whose message does not parse gets a problem line naming the message and the field, not a crash.
"""

from __future__ import annotations

import math
import queue
import time
from dataclasses import dataclass, field
from typing import Any

from agent.fleet.base.untrusted import clipped, shown
from agent.fleet.view.build_note import build_note
from agent.fleet.view.cameras import camera_down, camera_rows, camera_summary
from agent.fleet.view.targets import target_cell, target_notes, target_summary
from agent.mqtt.inbound import InboundMessage
from agent.mqtt.service_client import ServiceClient
from agent.mqtt.settings import MqttSettings
from agent.protocol.messages import InfoMessage, ProtocolError, StatusMessage, TelemetryMessage, decode
from agent.protocol.topics import fleet_filter, parse

#: Longest device text kept per field in ``--json`` output (a device can send megabytes).
JSON_TEXT_LIMIT = 1024
#: Slots listed per device in the table (a device can claim thousands).
_MAX_SLOTS_SHOWN = 8
#: Cameras listed per device in the table (``--json`` has every camera kept).
_MAX_CAMERAS_SHOWN = 8
#: Malformed-message notes kept per device (a device can publish malformed messages in a loop).
MAX_PROBLEMS = 5


@dataclass
class DeviceRow:
    """What the retained topics say about one device."""

    device: str
    state: str = "unknown"  # online | offline | unknown (no status retained)
    since: float | None = None  # when that status was published, Unix seconds
    session: int | None = None
    agent_version: str | None = None
    slots: dict[str, dict[str, Any]] = field(default_factory=dict)
    platform: dict[str, Any] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    #: A retained ``up/info`` was read (selectors are checked only against devices that sent one).
    info_seen: bool = False
    problems: list[str] = field(default_factory=list)
    #: From the latest ``up/telemetry`` heard (None: none heard, or the field was not in it).
    telemetry_at: float | None = None
    fps: float | None = None  # sum of the streams' ``stream.<s>.fps``
    cpu_percent: float | None = None  # ``cpu.percent`` (the whole system)
    temp_c: float | None = None  # the hottest ``temp.<zone>_c``
    #: Each camera from ``up/info`` (agent.fleet.view.cameras.camera_summary), by stream name.
    cameras: dict[str, dict[str, Any]] = field(default_factory=dict)
    cameras_listed: int = 0  # cameras in the device's up/info, those past MAX_CAMERAS included
    #: The latest telemetry's per-camera figures (``stream.<s>.fps``, ``.capture_fps``, ``.source.*``).
    camera_figures: dict[str, float] = field(default_factory=dict)

    def camera_rows(self) -> list[dict[str, Any]]:
        """Each camera with its latest figures (agent.fleet.view.cameras.camera_rows)."""
        return camera_rows(self.cameras, self.camera_figures)

    #: When the client certificate the device connects with expires (``up/info``; None: not said).
    cert_not_after: float | None = None
    #: Its configuration overlay and agent release (agent.fleet.view.targets.target_summary).
    targets: dict[str, dict[str, Any]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The row for ``--json``, every device string cut to :data:`JSON_TEXT_LIMIT` characters."""
        row: dict[str, Any] = clip_strings(
            {
                "device": self.device,
                "state": self.state,
                "since": self.since,
                "session": self.session,
                "agent_version": self.agent_version,
                "slots": self.slots,
                "platform": self.platform,
                "labels": self.labels,
                "problems": self.problems,
                "telemetry_at": self.telemetry_at,
                "fps": self.fps,
                "cpu_percent": self.cpu_percent,
                "temp_c": self.temp_c,
                "cameras": self.camera_rows(),
                "cert_not_after": self.cert_not_after,
                "targets": self.targets,
            }
        )
        return row


def clip_strings(value: Any) -> Any:
    """``value`` with every string (keys too) cut to :data:`JSON_TEXT_LIMIT` characters."""
    if isinstance(value, str):
        return clipped(value, JSON_TEXT_LIMIT)
    if isinstance(value, dict):
        return {clipped(str(k), JSON_TEXT_LIMIT): clip_strings(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clip_strings(v) for v in value]
    return value


def collect_fleet(
    settings: MqttSettings,
    *,
    quiet_s: float = 0.5,
    max_wait_s: float = 5.0,
    timeout: float = 10.0,
    telemetry_wait_s: float = 0.0,
) -> list[DeviceRow]:
    """Subscribe to every device's retained status and info; rows sorted by device id.

    ``telemetry_wait_s`` > 0 also listens to ``up/telemetry`` and, once the retained messages are
    in, goes on until every online device sent one (or that long after the start).

    Raises TransportError when the broker cannot be reached.
    """
    arrivals: queue.Queue[InboundMessage] = queue.Queue()
    client = ServiceClient(settings, handler=arrivals.put)
    client.start(timeout)
    try:
        client.subscribe(fleet_filter(settings.prefix, "status"), qos=1, timeout=timeout)
        client.subscribe(fleet_filter(settings.prefix, "info"), qos=1, timeout=timeout)
        if telemetry_wait_s > 0:
            client.subscribe(fleet_filter(settings.prefix, "telemetry"), qos=0, timeout=timeout)
        rows: dict[str, DeviceRow] = {}
        start = time.monotonic()
        retained_until = start + max_wait_s
        telemetry_until = start + telemetry_wait_s
        retained_done = False
        info_heard: set[str] = set()
        while True:
            now = time.monotonic()
            if not retained_done:
                wait = min(quiet_s, retained_until - now)
            elif now >= telemetry_until or all(
                r.telemetry_at is not None for r in rows.values() if r.state == "online"
            ):
                break
            else:
                wait = telemetry_until - now
            if wait <= 0:
                retained_done = True
                continue
            try:
                message = arrivals.get(timeout=wait)
            except queue.Empty:
                if retained_done:
                    break
                # An online device publishes its info as it connects: one whose info has not come
                # yet (a large one, a loaded host) is waited for, up to max_wait_s.
                waiting = any(r.state == "online" and d not in info_heard for d, r in rows.items())
                retained_done = not waiting or time.monotonic() >= retained_until
                continue
            _apply(rows, message, settings.prefix)
            if message.topic.endswith("/up/info"):
                info_heard.add(message.topic.rsplit("/", 3)[-3])
    finally:
        client.stop()
    return [rows[d] for d in sorted(rows)]


def _apply(rows: dict[str, DeviceRow], message: InboundMessage, prefix: str) -> None:
    try:
        topic = parse(message.topic, prefix)
    except ValueError:
        return
    if not message.payload:
        return  # a cleared retained topic
    row = rows.setdefault(topic.device, DeviceRow(topic.device))
    try:
        if topic.kind == "status":
            status = decode(StatusMessage, message.payload)
            row.state, row.since, row.session = status.state, status.ts, status.session
            row.agent_version = row.agent_version or status.agent_version
        elif topic.kind == "info":
            info = decode(InfoMessage, message.payload)
            row.agent_version = info.agent_version
            row.platform = dict(info.platform)
            row.labels = dict(info.labels)
            row.info_seen = True
            row.slots = slot_summary(info)
            row.cameras = camera_summary(info)
            row.cameras_listed = len(info.cameras)
            row.cert_not_after = None if info.certificate is None else info.certificate.not_after
            row.targets = target_summary(info)
        elif topic.kind == "telemetry":
            _apply_telemetry(row, decode(TelemetryMessage, message.payload))
    except ProtocolError as exc:
        if len(row.problems) < MAX_PROBLEMS:
            row.problems.append(f"{topic.kind}: {exc}")


def slot_summary(info: InfoMessage) -> dict[str, dict[str, Any]]:
    """Each slot of ``info`` as the plain dict ``fleet status --json`` and the fleet view show:
    model id/version/sha256, state, why it is empty, its last job and how it ended, its last failure."""
    return {
        name: {
            "model_id": slot.model.model_id if slot.model else None,
            "version": slot.model.version if slot.model else None,
            "sha256": slot.model.sha256 if slot.model else None,
            "state": slot.state,
            "reason": slot.reason,
            "last_job": slot.last_job,
            "last_job_state": slot.last_job_state.value if slot.last_job_state else None,
            "last_job_error_code": slot.last_job_error_code,
            # It keeps serving, released under a key revoked since (docs/trust.md).
            "release_revoked": slot.release_revoked,
            "last_failure": slot.last_failure.model_dump(mode="json") if slot.last_failure else None,
            # A start-up build: the slot serves its ONNX model meanwhile (docs/engines.md).
            "serving": slot.serving,
            "building": build_note(slot.building) or None,
            # What really runs: the precision asked and running, the engine's source, any fallback.
            "runs": slot.runs.model_dump(mode="json", exclude_none=True) if slot.runs else None,
        }
        for name, slot in info.slots.items()
    }


def _apply_telemetry(row: DeviceRow, telemetry: TelemetryMessage) -> None:
    """The table's figures from one telemetry message (field names: docs/operations.md)."""
    values = telemetry.fields()
    fps = [v for k, v in values.items() if k.startswith("stream.") and k.endswith(".fps")]
    temps = [v for k, v in values.items() if k.startswith("temp.") and k.endswith("_c")]
    row.telemetry_at = telemetry.ts
    row.fps = sum(fps) if fps else None
    row.cpu_percent = values.get("cpu.percent")
    row.temp_c = max(temps) if temps else None
    row.camera_figures = {k: v for k, v in values.items() if _camera_figure(k)}


def _camera_figure(name: str) -> bool:
    return name.startswith("stream.") and name.endswith((".fps", ".capture_fps", ".source.last_frame_age_s"))


def platform_bits(platform: dict[str, Any]) -> str:
    """A short platform description: board or machine, JetPack, TensorRT, DLA cores."""
    parts = [shown(platform.get("device_model") or platform.get("machine") or "?", 40)]
    if platform.get("jetpack"):
        parts.append(f"JetPack {shown(platform['jetpack'], 16)}")
    if platform.get("tensorrt_version"):
        parts.append(f"TRT {shown(platform['tensorrt_version'], 16)}")
    elif platform.get("onnxruntime_version"):
        parts.append(f"ORT {shown(platform['onnxruntime_version'], 16)}")
    if platform.get("dla_cores"):
        parts.append(f"{shown(platform['dla_cores'], 4)} DLA")
    return ", ".join(parts)


def age(seconds: float) -> str:
    """``42s``, ``7m03s``, ``5h12m``, ``3d04h``; ``?`` for a time that is not a number."""
    if not math.isfinite(seconds):
        return "?"  # messages refuse non-finite times; a DeviceRow made in code may still hold one
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _slot_cell(name: str, slot: dict[str, Any]) -> str:
    """``main=mobilenet:4``; an empty slot says so (``main=empty``; a note line says why)."""
    if slot["model_id"] is None:
        return f"{shown(name, 24)}={shown(slot['state'] or 'empty', 16)}"
    cell = f"{shown(name, 24)}={shown(slot['model_id'], 40)}:{shown(slot['version'] or '-', 24)}"
    # A note line says why; the cell marks it so a wide table still shows which slot.
    return cell + " (revoked key)" if slot.get("release_revoked") else cell


def runs_text(runs: dict[str, Any] | None) -> str:
    """What a slot runs, in a few words: ``int8 built``, ``fp32 built, int8 asked`` (a fallback),
    ``fp16 downloaded``, ``interim, int8 builds``, ``as given``; "" when the slot did not say."""
    if not runs:
        return ""
    source = shown(runs.get("source") or "?", 16)
    requested = shown(runs["requested"], 16) if runs.get("requested") else None
    if source == "interim":
        return f"interim, {requested} builds" if requested else "interim"
    if source == "model":
        return "as given"
    text = f"{shown(runs.get('precision') or '?', 16)} {source}"
    return f"{text}, {requested} asked" if runs.get("fallback") and requested else text


def _runs_cell(slots: dict[str, dict[str, Any]]) -> str:
    """``slot=fp32 built, int8 asked`` per slot that says what it runs."""
    cells = []
    for name, s in sorted(slots.items())[:_MAX_SLOTS_SHOWN]:
        text = runs_text(s.get("runs"))
        if text:
            cells.append(f"{shown(name, 24)}={text}")
    return " ".join(cells)


def figure(value: float | None, unit: str = "") -> str:
    """A telemetry figure for a table cell: ``24.9``, ``37%``; ``-`` when absent; never wide."""
    if value is None:
        return "-"
    # A device may send 1e308 (finite, so valid): it must not print 309 digits.
    if abs(value) >= 1e6:
        text = f"{value:.2g}"
    elif unit:
        text = f"{value:.0f}"
    else:
        text = f"{value:.1f}"
    return text + unit


def last_job_cell(slots: dict[str, dict[str, Any]]) -> str:
    """``slot=job-id STATE code`` per slot: the last job, a refused one included, and how it stands."""
    cells = []
    for name, s in sorted(slots.items())[:_MAX_SLOTS_SHOWN]:
        if not s.get("last_job"):
            continue
        cell = f"{shown(name, 24)}={shown(s['last_job'], 64)}"
        if s.get("last_job_state"):
            cell += f" {shown(s['last_job_state'], 16)}"
        if s.get("last_job_error_code"):
            cell += f" {shown(s['last_job_error_code'], 24)}"
        cells.append(cell)
    return " ".join(cells)


def last_failure_cell(slots: dict[str, dict[str, Any]], now: float) -> str:
    """``slot=code age`` per slot with a failure: the last job that ended FAILED, REJECTED, ROLLED_BACK."""
    cells = []
    for name, s in sorted(slots.items())[:_MAX_SLOTS_SHOWN]:
        failure = s.get("last_failure")
        if not failure:
            continue
        what = failure.get("error_code") or failure.get("state") or "?"
        cells.append(f"{shown(name, 24)}={shown(what, 24)} {age(now - failure['ts'])} ago")
    return " ".join(cells)


def cameras_cell(cameras: list[dict[str, Any]], listed: int) -> str:
    """``cam0=streaming 25.0fps dock=reconnecting`` for the first cameras by name; ``listed``: how
    many the device has."""
    cells = []
    for c in cameras[:_MAX_CAMERAS_SHOWN]:
        cell = f"{shown(c['stream'], 24)}={shown(c.get('state') or '?', 16)}"
        if c.get("capture_fps") is not None:
            cell += f" {figure(c['capture_fps'])}fps"
        cells.append(cell)
    shown_count = min(len(cameras), _MAX_CAMERAS_SHOWN)
    if max(listed, len(cameras)) > shown_count:
        cells.append(f"(+{max(listed, len(cameras)) - shown_count} more)")
    return " ".join(cells)


def camera_note(camera: dict[str, Any], now: float) -> str:
    """Why a camera is down, in a line: ``camera dock reconnecting for 2m10s, 14 reconnects, last
    frame 2m12s ago: <its last error>``."""
    text = f"camera {shown(camera['stream'], 24)} {shown(camera.get('state') or '?', 16)}"
    since = camera.get("since")
    if isinstance(since, int | float):
        text += f" for {shown(age(now - since), 16)}"
    text += f", {figure(camera.get('reconnects'), ' reconnects')}"
    if camera.get("last_frame_age_s") is not None:
        text += f", last frame {shown(age(camera['last_frame_age_s']), 16)} ago"
    if camera.get("last_error"):
        text += f": {shown(camera['last_error'], 300)}"
    return text


def cert_days(not_after: float | None, now: float) -> str:
    """Days until the device's certificate expires (``expired`` past it; ``-``: not said)."""
    if not_after is None:
        return "-"
    days = (not_after - now) / 86400
    return "expired" if days <= 0 else f"{days:.0f}d" if days >= 2 else f"{days * 24:.0f}h"


def format_table(rows: list[DeviceRow], now: float | None = None) -> str:
    """The devices as an aligned text table (one line per device), then one line per problem.

    Every cell a device controls is passed through :func:`shown`: no control characters reach the
    terminal and no cell is longer than its cap, whatever the device sent.
    """
    now = time.time() if now is None else now
    header = (
        "DEVICE",
        "STATUS",
        "AGENT",
        "FPS",
        "CPU",
        "TEMP",
        "CONFIG",
        "RELEASE",
        "SLOTS (model:version)",
        "RUNS (precision, engine)",
        "CAMERAS",
        "LAST JOB",
        "LAST FAILURE",
        "PLATFORM",
        "CERT",
    )
    lines: list[tuple[str, ...]] = [header]
    notes: list[str] = []
    for row in rows:
        device = shown(row.device, 40)
        status = row.state if row.since is None else f"{row.state} {age(now - row.since)}"
        cameras = row.camera_rows()
        slots = " ".join(_slot_cell(name, s) for name, s in sorted(row.slots.items())[:_MAX_SLOTS_SHOWN])
        if len(row.slots) > _MAX_SLOTS_SHOWN:
            slots += f" (+{len(row.slots) - _MAX_SLOTS_SHOWN} more)"
        lines.append(
            (
                device,
                shown(status, 24),
                shown(row.agent_version or "-", 24),
                figure(row.fps),
                figure(row.cpu_percent, "%"),
                figure(row.temp_c, "C"),
                target_cell("config", row.targets.get("config")),
                target_cell("agent", row.targets.get("agent")),
                slots or "-",
                _runs_cell(row.slots) or "-",
                cameras_cell(cameras, row.cameras_listed) or "-",
                last_job_cell(row.slots) or "-",
                last_failure_cell(row.slots, now) or "-",
                platform_bits(row.platform) if row.platform else "-",
                cert_days(row.cert_not_after, now),
            )
        )
        notes.extend(f"{device}: malformed {shown(problem, 200)}" for problem in row.problems)
        notes.extend(f"{device}: {camera_note(c, now)}" for c in cameras if camera_down(c))
        notes.extend(f"{device}: {note}" for note in target_notes(row.targets))
        notes.extend(
            f"{device}: slot {shown(name, 24)} is empty: {shown(s['reason'], 200)}"
            for name, s in sorted(row.slots.items())
            if s.get("reason") and not s["model_id"]
        )
        notes.extend(
            f"{device}: slot {shown(name, 24)} serves a model {shown(s['release_revoked'], 400)}"
            for name, s in sorted(row.slots.items())
            if s.get("release_revoked")
        )
        notes.extend(
            f"{device}: slot {shown(name, 24)} runs {shown(s['runs'].get('precision') or '?', 16)}, "
            f"{shown(s['runs'].get('requested') or '?', 16)} asked: {shown(s['runs']['fallback'], 300)}"
            for name, s in sorted(row.slots.items())
            if isinstance(s.get("runs"), dict) and s["runs"].get("fallback")
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    table = [
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines
    ]
    return "\n".join(table + notes)
