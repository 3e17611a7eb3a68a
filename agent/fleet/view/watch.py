"""``edge-agent fleet watch DEVICE``: what one device sends, live, one line per message.

Subscribes to ``{prefix}/{device}/up/#`` and prints results, telemetry, status, info, job states and
command replies as they arrive: readable lines (the demo's printer is the model; results at most one
line per stream every ``--every`` seconds), or with ``--json`` one JSON object per message for
scripts. Every message is checked against its protocol model first; one that does not parse is
shown as ``malformed`` with the reason, and the watch goes on. Device text passes
:func:`agent.fleet.base.untrusted.shown` (text mode) or the JSON encoder (``--json``) before it is printed.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from pydantic import BaseModel

from agent.errors import ConfigError
from agent.fleet.base.untrusted import clipped, clipped_strings, shown
from agent.fleet.view.build_note import build_note
from agent.mqtt.observer import Observer
from agent.mqtt.settings import MqttSettings
from agent.protocol.messages import (
    CommandReply,
    InfoMessage,
    JobStatus,
    ProtocolError,
    ResultMessage,
    StatusMessage,
    TelemetryMessage,
    decode,
)
from agent.protocol.topics import ParsedTopic, check_level, parse

#: The protocol model of each ``up`` topic kind; ``xfer`` (chunk requests) is the delivery's own
#: business and is shown only with ``--json``.
MODELS: dict[str, type[BaseModel]] = {
    "status": StatusMessage,
    "info": InfoMessage,
    "telemetry": TelemetryMessage,
    "results": ResultMessage,
    "jobs": JobStatus,
    "cmd": CommandReply,
}
#: Longest malformed-message reason printed (it quotes device text).
_REASON_LIMIT = 200
#: Longest string of a payload printed by ``--json`` (the cap of ``fleet status --json``).
JSON_TEXT_LIMIT = 1024
#: Seconds of silence after which the watch says what may be wrong (once).
QUIET_HINT_S = 5.0


@dataclass(frozen=True)
class Seen:
    """One message from the device, parsed as far as it would go."""

    topic: ParsedTopic
    retained: bool
    message: BaseModel | None  # None: malformed (``problem`` says why) or a kind without a model
    problem: str | None = None


def read_message(topic: ParsedTopic, payload: bytes, retained: bool) -> Seen:
    """Check ``payload`` against the model of its topic kind; never raises on device input."""
    model = MODELS.get(topic.kind)
    if model is None:
        return Seen(topic, retained, None)
    try:
        return Seen(topic, retained, decode(model, payload))
    except ProtocolError as exc:
        return Seen(topic, retained, None, str(exc))


def _read_arrival(topic: str, payload: bytes, retained: bool, prefix: str, device: str) -> Seen:
    try:
        parsed = parse(topic, prefix)
    except ValueError as exc:
        # Under up/# but outside the topic tree: whoever holds the device's credentials sent it.
        kind = topic[len(f"{prefix}/{device}/up/") :].split("/", 1)[0] or "?"
        return Seen(ParsedTopic(device, "up", kind, None), retained, None, str(exc))
    return read_message(parsed, payload, retained)


def _model_text(ref: Any) -> str:
    version = ref.version if ref.version is not None else "-"
    return f"{shown(ref.model_id, 40)} v{shown(version, 20)}"


def _result_text(result: ResultMessage) -> str:
    if result.classes:
        top = result.classes[0]
        what = f"top: {shown(top.label, 40)} ({top.score:.2f})"
    elif result.detections is not None:
        dets = result.detections
        first = f", e.g. {shown(dets[0].label, 40)} {dets[0].score:.2f}" if dets else ""
        what = f"{len(dets)} objects{first}"
    else:
        what = f"{len(result.tensors or [])} tensors"
    total = result.latency_ms.get("total")
    latency = f"  {total:.1f} ms" if total is not None else ""
    return (
        f"{shown(result.stream, 20):<8} frame {result.frame_index:>6}  {_model_text(result.model)}  "
        f"{what}{latency}"
    )


def _telemetry_text(message: TelemetryMessage) -> str:
    values = message.fields()
    parts = []
    streams = sorted(
        k[len("stream.") : -len(".fps")] for k in values if k.startswith("stream.") and k.endswith(".fps")
    )
    for stream in streams:
        fps = values[f"stream.{stream}.fps"]
        p50 = values.get(f"stream.{stream}.latency.total.p50_ms", 0.0)
        p99 = values.get(f"stream.{stream}.latency.total.p99_ms", 0.0)
        parts.append(f"{shown(stream, 20)} {fps:.1f} fps p50 {p50:.0f} ms p99 {p99:.0f} ms")
    cpu, rss = values.get("process.cpu_percent"), values.get("process.rss_mb")
    if cpu is not None and rss is not None:
        parts.append(f"cpu {cpu:.0f}% rss {rss:.0f} MB")
    return " | ".join(parts) or f"{len(values)} fields"


def _info_text(info: InfoMessage) -> str:
    parts = [f"agent {shown(info.agent_version, 20)}"]
    for name, slot in sorted(info.slots.items())[:10]:
        model = _model_text(slot.model) if slot.model is not None else "no model yet"
        parts.append(f"slot {shown(name, 20)} {shown(slot.state, 20)}: {model}")
        if slot.serving == "interim":
            parts.append(f"slot {shown(name, 20)} serves its ONNX model while its engine builds")
        if slot.runs is not None and slot.runs.fallback:
            running, asked = shown(slot.runs.precision or "?", 16), shown(slot.runs.requested or "?", 16)
            parts.append(
                f"slot {shown(name, 20)} runs {running}, {asked} asked: {shown(slot.runs.fallback, 300)}"
            )
        if slot.building is not None:
            what = shown(slot.building.model_id, 40)
            parts.append(f"slot {shown(name, 20)} building {what}: {build_note(slot.building)}")
    parts.append(f"streams: {', '.join(shown(s, 20) for s in info.streams[:10]) or 'none'}")
    return "; ".join(parts)


def _job_text(job: JobStatus) -> str:
    progress = f" {job.progress * 100:.0f}%" if job.progress is not None else ""
    if job.build is not None:
        progress += f" ({build_note(job.build)})"
    error = f"  {shown(job.error_code, 40)}: {shown(job.error, 160)}" if job.error else ""
    return f"{shown(job.job_id, 24)}  slot {shown(job.slot, 20)}  {job.state.value}{progress}{error}"


def text_line(seen: Seen, at: float) -> str | None:
    """The line ``seen`` prints as in text mode (None: nothing to print), stamped with ``at``."""
    kind = seen.topic.kind
    stamp = time.strftime("%H:%M:%S", time.localtime(at))
    label = (
        "results" if kind == "results" else f"{kind} {shown(seen.topic.arg, 24)}" if seen.topic.arg else kind
    )
    if seen.problem is not None:
        return f"{stamp}  {label:<10} malformed: {shown(seen.problem, _REASON_LIMIT)}"
    message = seen.message
    retained = "  (retained)" if seen.retained else ""
    if isinstance(message, ResultMessage):
        return f"{stamp}  {_result_text(message)}"
    if isinstance(message, TelemetryMessage):
        return f"{stamp}  telemetry  {_telemetry_text(message)}"
    if isinstance(message, StatusMessage):
        return f"{stamp}  status     {message.state} (session {message.session}){retained}"
    if isinstance(message, InfoMessage):
        return f"{stamp}  info       {_info_text(message)}{retained}"
    if isinstance(message, JobStatus):
        return f"{stamp}  job        {_job_text(message)}"
    if isinstance(message, CommandReply):
        outcome = "ok" if message.ok else f"failed: {shown(message.error, 160)}"
        return f"{stamp}  reply      {shown(message.command, 24)} {outcome}"
    return None  # up/xfer/req: chunk requests, shown with --json only


def json_line(topic: str, seen: Seen, payload: bytes) -> str:
    """One JSON object: topic, kind, its argument, retained, and the payload as its model reads it
    (``malformed`` with the reason, and no payload, when it does not parse); every string of the
    payload cut at :data:`JSON_TEXT_LIMIT` characters."""
    document: dict[str, Any] = {
        "topic": topic,
        "kind": seen.topic.kind,
        "arg": seen.topic.arg,
        "retained": seen.retained,
    }
    if seen.message is not None:
        document["payload"] = seen.message.model_dump(mode="json", exclude_none=True)
    elif seen.problem is not None:
        document["malformed"] = clipped(seen.problem, _REASON_LIMIT)
    else:
        try:
            # NaN and the infinities (valid for Python's parser, not JSON) become null.
            document["payload"] = json.loads(payload, parse_constant=lambda _c: None)
        except ValueError as exc:
            document["malformed"] = clipped(f"not JSON: {exc}", _REASON_LIMIT)
    if "payload" in document:
        document["payload"] = clipped_strings(document["payload"], JSON_TEXT_LIMIT)
    # ensure_ascii (the default) writes device control characters as \\u escapes.
    return json.dumps(document)


@dataclass
class ResultPacing:
    """At most one result line per stream every ``every`` seconds (0: every result)."""

    every: float
    _last: dict[str, float] = field(default_factory=dict)

    def due(self, stream: str, now: float) -> bool:
        if self.every <= 0:
            return True
        last = self._last.get(stream)
        if last is not None and now - last < self.every:
            return False
        self._last[stream] = now
        return True


@dataclass(frozen=True)
class WatchOptions:
    """How long to watch and what to print."""

    as_json: bool = False
    every: float = 1.0
    count: int | None = None  # stop after this many printed lines
    duration: float | None = None  # stop after this many seconds


def watch_device(
    settings: MqttSettings,
    device: str,
    options: WatchOptions,
    stop: threading.Event,
    *,
    out: TextIO,
    err: TextIO,
    clock: Callable[[], float] = time.time,
) -> int:
    """Print what ``device`` sends until ``stop``, ``options.count`` lines or ``options.duration``.

    Returns 0. Raises ConfigError for a device id that cannot be a topic level, TransportError when
    the broker cannot be reached.
    """
    try:
        check_level(device, "device id")
    except ValueError as exc:
        raise ConfigError(f"DEVICE {device!r}: {exc}") from exc
    topic_filter = f"{settings.prefix}/{device}/up/#"
    observer = Observer(settings, [topic_filter]).start()
    print(f"watching {topic_filter} on {settings.host}:{settings.port} (Ctrl-C stops)", file=err, flush=True)
    pacing = ResultPacing(options.every)
    printed = 0
    started = last_heard = time.monotonic()
    hinted = False
    try:
        while not stop.is_set():
            now = time.monotonic()
            if options.duration is not None and now - started >= options.duration:
                break
            arrival = observer.get(0.2)
            if arrival is None:
                if not hinted and now - last_heard >= QUIET_HINT_S:
                    hinted = True
                    print(
                        f"nothing from {shown(device)} in {QUIET_HINT_S:.0f} s: is it running, on this "
                        f"broker, with prefix {settings.prefix}? (`edge-agent fleet status` lists devices)",
                        file=err,
                        flush=True,
                    )
                continue
            last_heard = time.monotonic()
            topic, payload, retained = arrival
            seen = _read_arrival(topic, payload, retained, settings.prefix, device)
            paced = seen.topic.kind == "results" and seen.message is not None and not options.as_json
            if paced and not pacing.due(seen.topic.arg or "", last_heard):
                continue
            line = json_line(topic, seen, payload) if options.as_json else text_line(seen, clock())
            if line is None:
                continue
            print(line, file=out, flush=True)
            printed += 1
            if options.count is not None and printed >= options.count:
                break
    finally:
        observer.stop()
    return 0
