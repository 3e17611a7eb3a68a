"""``fleet status``: every device's retained ``up/status`` and ``up/info`` as a table (or JSON).

Retained messages arrive right after the subscription; there is no end marker, so collection stops
after a short quiet period (or a bounded total wait).
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import Any

from agent.mqtt.inbox import InboundMessage
from agent.mqtt.service_client import ServiceClient
from agent.mqtt.settings import MqttSettings
from agent.protocol.messages import InfoMessage, ProtocolError, StatusMessage, decode
from agent.protocol.topics import fleet_filter, parse


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
    problems: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The row for ``--json``."""
        return {
            "device": self.device,
            "state": self.state,
            "since": self.since,
            "session": self.session,
            "agent_version": self.agent_version,
            "slots": self.slots,
            "platform": self.platform,
            "problems": self.problems,
        }


def collect_fleet(
    settings: MqttSettings, *, quiet_s: float = 0.5, max_wait_s: float = 5.0, timeout: float = 10.0
) -> list[DeviceRow]:
    """Subscribe to every device's retained status and info; rows sorted by device id.

    Raises TransportError when the broker cannot be reached.
    """
    arrivals: queue.Queue[InboundMessage] = queue.Queue()
    client = ServiceClient(settings, handler=arrivals.put)
    client.start(timeout)
    try:
        client.subscribe(fleet_filter(settings.prefix, "status"), qos=1, timeout=timeout)
        client.subscribe(fleet_filter(settings.prefix, "info"), qos=1, timeout=timeout)
        rows: dict[str, DeviceRow] = {}
        deadline = time.monotonic() + max_wait_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                message = arrivals.get(timeout=min(quiet_s, left))
            except queue.Empty:
                break
            _apply(rows, message, settings.prefix)
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
            row.slots = {
                name: {
                    "model_id": slot.model.model_id if slot.model else None,
                    "version": slot.model.version if slot.model else None,
                    "sha256": slot.model.sha256 if slot.model else None,
                    "state": slot.state,
                    "last_job": slot.last_job,
                }
                for name, slot in info.slots.items()
            }
    except ProtocolError as exc:
        row.problems.append(f"{topic.kind}: {exc}")


def platform_bits(platform: dict[str, Any]) -> str:
    """A short platform description: board or machine, JetPack, TensorRT, DLA cores."""
    parts = [str(platform.get("device_model") or platform.get("machine") or "?")]
    if platform.get("jetpack"):
        parts.append(f"JetPack {platform['jetpack']}")
    if platform.get("tensorrt_version"):
        parts.append(f"TRT {platform['tensorrt_version']}")
    elif platform.get("onnxruntime_version"):
        parts.append(f"ORT {platform['onnxruntime_version']}")
    if platform.get("dla_cores"):
        parts.append(f"{platform['dla_cores']} DLA")
    return ", ".join(parts)


def age(seconds: float) -> str:
    """``42s``, ``7m03s``, ``5h12m``, ``3d04h``."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def format_table(rows: list[DeviceRow], now: float | None = None) -> str:
    """The devices as an aligned text table (one line per device)."""
    now = time.time() if now is None else now
    header = ("DEVICE", "STATUS", "AGENT", "SLOTS (model:version)", "LAST JOB", "PLATFORM")
    lines: list[tuple[str, ...]] = [header]
    for row in rows:
        status = row.state if row.since is None else f"{row.state} {age(now - row.since)}"
        slots = " ".join(
            f"{name}={s['model_id'] or '-'}:{s['version'] or '-'}" for name, s in sorted(row.slots.items())
        )
        jobs = " ".join(f"{name}={s['last_job']}" for name, s in sorted(row.slots.items()) if s["last_job"])
        lines.append(
            (
                row.device,
                status,
                row.agent_version or "-",
                slots or "-",
                jobs or "-",
                platform_bits(row.platform) if row.platform else "-",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )
