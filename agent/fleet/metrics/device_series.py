"""One device's series on the controller's ``/metrics``: its status, info, slot and job lines, rendered
when the device changes other than by telemetry (its telemetry lines:
:mod:`agent.fleet.metrics.figure_lines`).

A device chooses its id, labels, slots and figures, so each is bounded here: label values are cut to
:data:`~agent.telemetry.series.LABEL_VALUE_LIMIT` characters, a longer device id becomes
:func:`device_label` (cut, plus a hash of the whole id), device label keys become label names by
:func:`label_name`, at most :data:`MAX_SLOTS` slots per device get slot series, and a series that
would repeat after cutting is written once. :mod:`agent.fleet.metrics.kept_fleet` keeps the devices'
lines between scrapes.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from agent.fleet.metrics.text import FamilyHead, labels_text
from agent.fleet.view.live import DeviceState
from agent.telemetry.series import LABEL_VALUE_LIMIT

#: Slots per device with ``edge_slot_model_info`` and ``edge_slot_last_failure_timestamp_seconds``
#: (the first by name; ``edge_device_slots`` still counts them all). A Jetson serves a handful.
MAX_SLOTS = 64
#: Hex digits of the SHA-256 that end a cut device id (64 bits: no accidental collision in a fleet).
DEVICE_HASH_CHARS = 16
#: Platform fields exported on ``edge_device_platform_info``.
PLATFORM_KEYS = (
    "device_model",
    "machine",
    "jetpack",
    "l4t_release",
    "cuda_runtime",
    "tensorrt_version",
    "onnxruntime_version",
    "gpu_name",
    "dla_cores",
)
#: The labels of ``edge_slot_precision_fallback`` besides device and slot, from the slot's ``runs``.
_RUNS_LABELS = ("requested", "precision", "source")
_OURS = frozenset({"device", "agent_version", "job", "instance"})
_BAD_LABEL_CHARS = re.compile(r"[^a-zA-Z0-9_]")
ONLINE = FamilyHead("edge_device_online", "gauge", "1 while the device's retained status says online.")
STALE = FamilyHead(
    "edge_device_stale", "gauge", "1 when the device is offline or sent no telemetry for stale_after_s."
)
SESSION = FamilyHead("edge_device_session", "gauge", "The device's connection counter.")
LAST_TELEMETRY = FamilyHead(
    "edge_device_last_telemetry_timestamp_seconds",
    "gauge",
    "When the controller last heard the device's telemetry.",
)
PROBLEMS = FamilyHead(
    "edge_device_malformed_messages",
    "gauge",
    "Malformed messages from the device kept by the controller (capped).",
)
CERT_EXPIRY = FamilyHead(
    "edge_device_certificate_expiry_timestamp_seconds",
    "gauge",
    "When the client certificate the device connects with expires (up/info); days left: "
    "(this - time()) / 86400.",
)
INFO = FamilyHead("edge_device_info", "gauge", "The device's agent version and labels (join on device).")
PLATFORM = FamilyHead("edge_device_platform_info", "gauge", "What the device runs on (from up/info).")
SLOTS = FamilyHead(
    "edge_device_slots", "gauge", f"Slots in the device's up/info (the first {MAX_SLOTS} get slot series)."
)
MODEL = FamilyHead("edge_slot_model_info", "gauge", "The model a slot serves (from up/info).")
PRECISION = FamilyHead(
    "edge_slot_precision_fallback",
    "gauge",
    "1 when the slot runs another precision than its build asked, else 0 (labels: what was asked, "
    "what runs, where the engine came from; from up/info).",
)
#: Characters of a precision or engine source label a device chose (real ones: fp32, downloaded).
PRECISION_LABEL_CHARS = 16
JOB = FamilyHead("edge_slot_job_info", "gauge", "The latest job heard for the slot (up/jobs).")
FAILURE = FamilyHead(
    "edge_slot_last_failure_timestamp_seconds",
    "gauge",
    "When the slot's last failed job ended, by its error code.",
)
#: The per-device families before the telemetry ones, in the order they are written.
DEVICE_FAMILIES = (
    ONLINE,
    STALE,
    SESSION,
    LAST_TELEMETRY,
    PROBLEMS,
    CERT_EXPIRY,
    INFO,
    PLATFORM,
    SLOTS,
    MODEL,
    PRECISION,
    JOB,
    FAILURE,
)


def label_value(text: object) -> str:
    """A label value a device chose, cut to LABEL_VALUE_LIMIT characters ("" for none)."""
    return "" if text is None else str(text)[:LABEL_VALUE_LIMIT]


def label_name(key: str) -> str:
    """A device label key as a Prometheus label name (``example.com/site`` -> ``example_com_site``)."""
    name = _BAD_LABEL_CHARS.sub("_", key)
    if name in _OURS or name.startswith("__") or name[:1].isdigit():
        name = f"label_{name}"
    return name


def device_label(device: str) -> str:
    """The ``device`` label of a device id: the id itself up to LABEL_VALUE_LIMIT characters, else its
    first characters, ``/`` and :data:`DEVICE_HASH_CHARS` hex digits of the whole id's SHA-256 (128
    characters in all). A device id is an MQTT topic level, which never holds ``/``: a cut id cannot
    equal another device's real id, and two cut ids are equal only if their hashes are."""
    if len(device) <= LABEL_VALUE_LIMIT:
        return device
    digest = hashlib.sha256(device.encode("utf-8", "surrogatepass")).hexdigest()[:DEVICE_HASH_CHARS]
    return f"{device[: LABEL_VALUE_LIMIT - DEVICE_HASH_CHARS - 1]}/{digest}"


class _Lines:
    """One device's sample lines by family, each series once (cut label values may repeat)."""

    def __init__(self) -> None:
        self.by_family: dict[str, list[str]] = {}
        self._seen: set[tuple[str, str]] = set()

    def add(self, head: FamilyHead, labels: str, value: float) -> None:
        key = (head.name, labels)
        if key in self._seen:
            return
        self._seen.add(key)
        line = head.line(labels, value)
        chunk = self.by_family.get(head.name)
        if chunk is None:
            self.by_family[head.name] = [line]
        else:
            chunk.append(line)

    def joined(self) -> dict[str, str]:
        return {name: "".join(chunk) for name, chunk in self.by_family.items()}


def device_lines(d: DeviceState, dev: str) -> dict[str, str]:
    """The status, platform and slot lines of one device (``dev``: its escaped ``device`` label)."""
    base = f'device="{dev}"'
    # One line each, labelled by the device alone: nothing to check for repeats.
    single = {
        ONLINE.name: ONLINE.line(base, 1.0 if d.state == "online" else 0.0),
        STALE.name: STALE.line(base, 1.0 if d.stale else 0.0),
        PROBLEMS.name: PROBLEMS.line(base, len(d.problems)),
        SLOTS.name: SLOTS.line(base, max(d.slots_listed, len(d.slots))),
    }
    if d.session is not None:
        single[SESSION.name] = SESSION.line(base, d.session)
    if d.cert_not_after is not None:
        single[CERT_EXPIRY.name] = CERT_EXPIRY.line(base, d.cert_not_after)
    if d.platform:
        platform = labels_text([(k, label_value(d.platform.get(k))) for k in PLATFORM_KEYS])
        single[PLATFORM.name] = PLATFORM.line(f"{base},{platform}", 1.0)
    lines = _Lines()
    for name in sorted(d.slots)[:MAX_SLOTS]:
        slot = d.slots[name]
        model = labels_text(
            [
                ("slot", label_value(name)),
                ("model_id", label_value(slot.get("model_id"))),
                ("version", label_value(slot.get("version"))),
                ("sha256", label_value(slot.get("sha256"))),
                ("state", label_value(slot.get("state"))),
            ]
        )
        lines.add(MODEL, f"{base},{model}", 1.0)
        runs = slot.get("runs")
        if isinstance(runs, dict):
            precision = labels_text(
                [("slot", label_value(name))]
                + [(key, label_value(runs.get(key))[:PRECISION_LABEL_CHARS]) for key in _RUNS_LABELS]
            )
            lines.add(PRECISION, f"{base},{precision}", 1.0 if runs.get("fallback") else 0.0)
        last = slot.get("last_failure")
        if isinstance(last, dict) and isinstance(last.get("ts"), (int, float)):
            code = last.get("error_code") or last.get("state")
            failure = labels_text([("slot", label_value(name)), ("error_code", label_value(code))])
            lines.add(FAILURE, f"{base},{failure}", float(last["ts"]))
    latest: dict[str, Any] = {}
    for seen in d.jobs:  # latest first: the first per slot is its latest job (at most MAX_JOBS)
        latest.setdefault(seen.slot, seen)
    for slot_name, seen in sorted(latest.items()):
        job = labels_text(
            [
                ("slot", label_value(slot_name)),
                ("job_id", label_value(seen.job_id)),
                ("state", seen.state),
                ("error_code", label_value(seen.error_code)),
            ]
        )
        lines.add(JOB, f"{base},{job}", 1.0)
    return {**single, **lines.joined()}
