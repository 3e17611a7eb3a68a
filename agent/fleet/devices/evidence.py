"""``fleet evidence``: the frames a device's shadow run rejected a candidate on, with both outputs.

The device keeps them (``evidence`` command, docs/protocol.md): an index first, then one frame per
request, so every reply fits the MQTT payload limit. Here the replies are checked: at most
:data:`MAX_FRAMES` frames are fetched whatever the index says, each must decode as a JPEG, and what
a device says is kept only as bounded JSON.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.errors import TransportError
from agent.fleet.devices.command import DeviceRefusedError, send_command
from agent.fleet.devices.snapshot import jpeg_of_reply
from agent.fsutil import atomic_write_bytes
from agent.mqtt.settings import MqttSettings
from agent.protocol.messages import CommandReply

#: Frames fetched at most per job, whatever a device's index claims (a device keeps 6 by default).
MAX_FRAMES = 16


class BadEvidenceError(TransportError):
    """A device's evidence reply lacks its fields, or its JPEG does not decode."""

    code = "bad_evidence"

    def __init__(self, message: str) -> None:
        # Ends with its code, as a device's own refusal does ("... (no_evidence)").
        super().__init__(f"{message} ({self.code})")


@dataclass(frozen=True)
class EvidenceFrame:
    """One frame: the JPEG and what the device said of it (agreement, both models' outputs)."""

    jpeg: bytes
    meta: dict[str, Any]


@dataclass(frozen=True)
class DeviceEvidence:
    """A rejected job's evidence: the index (job, slot, reason, both models) and its frames."""

    index: dict[str, Any]
    frames: list[EvidenceFrame]


def _result(reply: CommandReply) -> dict[str, Any]:
    if not reply.ok:
        raise DeviceRefusedError(reply)
    return dict(reply.result or {})


def frame_from_reply(reply: CommandReply) -> EvidenceFrame:
    """One frame's reply, checked; DeviceRefusedError for ``ok: false``, BadEvidenceError for junk."""
    result = _result(reply)
    required = ("frame", "agreement", "serving", "candidate")
    what = "evidence frame"
    return EvidenceFrame(jpeg_of_reply(result, required, BadEvidenceError, what=what, image=what), result)


def fetch_evidence(
    settings: MqttSettings, device: str, job_id: str, *, timeout: float = 10.0
) -> DeviceEvidence:
    """Ask ``device`` for ``job_id``'s index, then each of its frames (at most :data:`MAX_FRAMES`)."""
    index = _result(send_command(settings, device, "evidence", {"job_id": job_id}, timeout=timeout))
    listed = index.get("frames")
    if not isinstance(listed, list):
        raise BadEvidenceError("the device's evidence index has no frames list")
    frames = [
        frame_from_reply(
            send_command(settings, device, "evidence", {"job_id": job_id, "frame": n}, timeout=timeout)
        )
        for n in range(min(len(listed), MAX_FRAMES))
    ]
    index["frames"] = listed[:MAX_FRAMES]
    return DeviceEvidence(index, frames)


def evidence_json(evidence: DeviceEvidence) -> dict[str, Any]:
    """What the console's evidence route answers: the index, each frame with its JPEG as base64."""
    frames = [{**f.meta, "jpeg_base64": base64.b64encode(f.jpeg).decode("ascii")} for f in evidence.frames]
    return {**evidence.index, "frames": frames}


def save_evidence(evidence: DeviceEvidence, directory: Path) -> list[Path]:
    """Write ``frame-NN.jpg`` per frame and ``evidence.json`` (the index and both models' outputs)."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    described = []
    for n, frame in enumerate(evidence.frames):
        path = directory / f"frame-{n:02d}.jpg"
        atomic_write_bytes(path, frame.jpeg)
        written.append(path)
        described.append({**frame.meta, "file": path.name})
    summary = directory / "evidence.json"
    text = json.dumps({**evidence.index, "frames": described}, indent=2)
    atomic_write_bytes(summary, text.encode("utf-8"))
    return [*written, summary]
