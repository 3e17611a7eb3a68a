"""``fleet snapshot``: a device's latest frame of a stream as a JPEG, with that frame's result.

The device encodes it (``snapshot`` command, docs/protocol.md): downscaled to its
``snapshot.max_dimension``, within its byte budget and rate. Here the reply is checked and decoded:
what a device sends is bounded (the JPEG's base64 text, by the MQTT payload limit the reply came
through) and what does not decode as a JPEG is refused, never written.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.errors import TransportError
from agent.fleet.devices.command import DeviceRefusedError, send_command
from agent.fsutil import atomic_write_bytes
from agent.mqtt.settings import MqttSettings
from agent.protocol.messages import CommandReply

#: How a JPEG file begins (SOI marker): a reply whose bytes do not is not a JPEG.
_JPEG_START = b"\xff\xd8"


class BadSnapshotError(TransportError):
    """A device's snapshot reply lacks the JPEG or its fields, or they do not decode."""

    code = "bad_snapshot"

    def __init__(self, message: str) -> None:
        # Ends with its code, as a device's own refusal does ("... (rate_limited)").
        super().__init__(f"{message} ({self.code})")


@dataclass(frozen=True)
class DeviceSnapshot:
    """A decoded snapshot reply: the JPEG bytes and what the device said about them."""

    jpeg: bytes
    #: The reply's result without ``jpeg_base64``: stream, frame_index, sizes, quality, result.
    meta: dict[str, Any]


def jpeg_of_reply(
    result: dict[str, Any], required: tuple[str, ...], error: type[TransportError], *, what: str, image: str
) -> bytes:
    """The JPEG a device's reply carries as ``jpeg_base64`` (popped from ``result``), checked along
    with the ``required`` keys; ``error`` names what is wrong (``what``: the reply, ``image``: its
    picture, in the operator's words). Snapshots and evidence frames travel the same way."""
    text = result.pop("jpeg_base64", None)
    if not isinstance(text, str):
        raise error(f"the device's {what} has no jpeg_base64 text")
    try:
        jpeg = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise error(f"the device's jpeg_base64 is not base64 ({exc})") from exc
    if not jpeg.startswith(_JPEG_START):
        raise error(f"the device's {image} is not a JPEG (no SOI marker)")
    for key in required:
        if key not in result:
            raise error(f"the device's {what} has no {key!r}")
    return jpeg


def snapshot_from_reply(reply: CommandReply) -> DeviceSnapshot:
    """The snapshot in ``reply``; DeviceRefusedError for ``ok: false``, BadSnapshotError for junk."""
    if not reply.ok:
        raise DeviceRefusedError(reply)
    result = dict(reply.result or {})
    required = ("stream", "frame_index", "width", "height")
    jpeg = jpeg_of_reply(result, required, BadSnapshotError, what="snapshot reply", image="snapshot")
    return DeviceSnapshot(jpeg, result)


def take_snapshot(
    settings: MqttSettings,
    device: str,
    *,
    stream: str | None = None,
    max_dimension: int | None = None,
    timeout: float = 10.0,
) -> DeviceSnapshot:
    """Ask ``device`` for the latest frame of ``stream`` (None: its first); NoReplyError after ``timeout``."""
    args: dict[str, Any] = {}
    if stream is not None:
        args["stream"] = stream
    if max_dimension is not None:
        args["max_dimension"] = max_dimension
    return snapshot_from_reply(send_command(settings, device, "snapshot", args, timeout=timeout))


def snapshot_json(snapshot: DeviceSnapshot) -> dict[str, Any]:
    """What the console's snapshot route answers: the device's fields and the (checked) JPEG as base64."""
    return {**snapshot.meta, "jpeg_base64": base64.b64encode(snapshot.jpeg).decode("ascii")}


def save_snapshot(snapshot: DeviceSnapshot, path: Path) -> None:
    """Write the JPEG to ``path`` (temp + fsync + rename: a reader never sees half of it)."""
    atomic_write_bytes(path, snapshot.jpeg)
