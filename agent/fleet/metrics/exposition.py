"""The controller's ``/metrics``: the whole fleet as Prometheus series, from a :class:`FleetView`.

:class:`FleetMetrics` renders the exposition from the view (and, when given, the rollout store) at
scrape time, so nothing is kept twice and nothing drifts. What it exports:

- per device, from ``up/status`` and ``up/info`` (always, stale or not): ``edge_device_online``
  (1/0), ``edge_device_stale``, ``edge_device_session``, ``edge_device_info{device, agent_version,
  <each device label>} 1`` (join it with ``* on(device) group_left(site)``), ``edge_device_platform_info``,
  ``edge_device_slots`` (slots the device reports), ``edge_slot_model_info{device, slot, model_id,
  version, sha256, state} 1``, the latest job of each slot as ``edge_slot_job_info{..., job_id,
  state, error_code} 1``, ``edge_slot_last_failure_timestamp_seconds``,
  ``edge_device_last_telemetry_timestamp_seconds`` and ``edge_device_malformed_messages``;
- per device, from its latest ``up/telemetry``, every figure :mod:`agent.telemetry.series` knows
  (fps, latency percentiles, drops by reason, spool depth, CPU, RSS, temperatures, GPU/DLA load and
  clocks), each with a ``device`` label. A STALE device (offline, or silent for ``stale_after_s``)
  has these series left out, so Prometheus marks them stale rather than charting frozen values;
- per rollout: ``edge_rollout_info{rollout_id, slot, to_version, state} 1`` and
  ``edge_rollout_devices{rollout_id, wave, step, end}`` (device counts);
- ``edge_fleet_devices`` and ``edge_fleet_refused_devices_total`` (devices past the view's cap).

Bounds (a device chooses its id, labels, slots and figures; docs/fleet.md "Metrics"): label values
a device chose are cut to :data:`~agent.telemetry.series.LABEL_VALUE_LIMIT` characters; a device id
longer than that becomes :func:`device_label` (cut, plus a hash of the whole id, so two ids sharing a
long prefix never share a label); at most :data:`MAX_LABEL_KEYS` device label keys become label names
(``example.com/site`` -> ``example_com_site``; a key that would collide with a label of ours gets a
``label_`` prefix); at most :data:`MAX_SLOTS` slots per device get slot series; telemetry figures are
the view's (at most :data:`~agent.fleet.view.device_record.MAX_FIGURES` per device). One device's series that
would repeat after cutting are written once.

Speed: each device's lines are kept rendered between scrapes and redone only for the devices whose
entry in :meth:`FleetView.changes` moved (a message changed them, or they turned stale or fresh);
a telemetry message redoes that device's telemetry lines, not its status and info lines. The
rollout series are read again only when the store's change mark moved, and their device counts are
counted by SQLite. The text is written directly (:mod:`agent.fleet.metrics.text`) rather than
through ``prometheus_client``'s collectors, which format every sample at every scrape
(bench/metrics.py measures this tree or an older one).

:func:`serve_metrics` serves it on a plain HTTP server (no console); :func:`metrics_asgi_app` is the
ASGI app the console mounts at ``/metrics``. Both gzip the answer when the scraper accepts it.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import re
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from agent.fleet.metrics.text import CONTENT_TYPE, FamilyHead, escape, labels_text, number
from agent.fleet.rollout.records import RolloutRow
from agent.fleet.view.live import DeviceState, FleetView
from agent.telemetry.series import LABEL_VALUE_LIMIT, series_of

#: Device label keys exported on ``edge_device_info`` (the most used first; a fleet with more keys
#: than this has them in the console and in selectors, not in Prometheus).
MAX_LABEL_KEYS = 32
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
_OURS = frozenset({"device", "agent_version", "job", "instance"})
_BAD_LABEL_CHARS = re.compile(r"[^a-zA-Z0-9_]")
#: Telemetry names already turned into (family, label text after ``device``, scale); bounded like
#: :mod:`agent.telemetry.series`' own cache.
_FIGURES: dict[str, tuple[FamilyHead, str, float] | None] = {}
_FIGURES_LIMIT = 100_000

Rollouts = Callable[[], Sequence[RolloutRow]]
#: A rollout's device counts by (wave, step, end): :meth:`RolloutStore.device_counts`.
RolloutCounts = Callable[[str], Sequence[tuple[int, str, str, int]]]
#: Moves when the rollouts may have changed: :meth:`RolloutStore.change_mark`.
RolloutsMark = Callable[[], object]

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
INFO = FamilyHead("edge_device_info", "gauge", "The device's agent version and labels (join on device).")
PLATFORM = FamilyHead("edge_device_platform_info", "gauge", "What the device runs on (from up/info).")
SLOTS = FamilyHead(
    "edge_device_slots", "gauge", f"Slots in the device's up/info (the first {MAX_SLOTS} get slot series)."
)
MODEL = FamilyHead("edge_slot_model_info", "gauge", "The model a slot serves (from up/info).")
JOB = FamilyHead("edge_slot_job_info", "gauge", "The latest job heard for the slot (up/jobs).")
FAILURE = FamilyHead(
    "edge_slot_last_failure_timestamp_seconds",
    "gauge",
    "When the slot's last failed job ended, by its error code.",
)
ROLLOUT = FamilyHead("edge_rollout_info", "gauge", "A rollout and its state.")
ROLLOUT_DEVICES = FamilyHead(
    "edge_rollout_devices", "gauge", "Devices of a rollout by wave, controller step and job end."
)
FLEET = FamilyHead("edge_fleet_devices", "gauge", "Devices the controller has heard of, by state.")
REFUSED = FamilyHead(
    "edge_fleet_refused_devices_total",
    "counter",
    "Messages from devices the fleet view did not take: past its max_devices, or an id too long.",
)
#: The per-device families before the telemetry ones, in the order they are written.
_DEVICE_FAMILIES = (
    ONLINE,
    STALE,
    SESSION,
    LAST_TELEMETRY,
    PROBLEMS,
    INFO,
    PLATFORM,
    SLOTS,
    MODEL,
    JOB,
    FAILURE,
)


def _value(text: object) -> str:
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


def _figure(name: str) -> tuple[FamilyHead, str, float] | None:
    """A telemetry name's family, its labels' text after ``device`` (``,stream="cam0"``) and scale."""
    try:
        return _FIGURES[name]
    except KeyError:
        pass
    found = series_of(name)
    known = None
    if found is not None:
        rest = labels_text(found.labels)
        known = (FamilyHead(found.metric, found.kind, found.help), f",{rest}" if rest else "", found.scale)
    if len(_FIGURES) >= _FIGURES_LIMIT:
        _FIGURES.clear()
    _FIGURES[name] = known
    return known


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


@dataclass
class _Device:
    """What is kept of one device between scrapes: its rendered lines and what they were made of."""

    mark: tuple[int, int, bool]  # FleetView.changes()' entry when rendered
    dev: str  # its device label, escaped
    state: str
    lines: dict[str, str]  # family name -> this device's status, info and slot lines
    labels: dict[str, str]
    agent_version: str | None
    telemetry: dict[str, str] = field(default_factory=dict)  # family name -> this device's lines
    heads: dict[str, FamilyHead] = field(default_factory=dict)  # the telemetry families it has
    info_names: tuple[tuple[str, str], ...] | None = None  # the label names info_line was made with
    info_line: str = ""


def _device_lines(d: DeviceState, dev: str) -> dict[str, str]:
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
    if d.platform:
        platform = labels_text([(k, _value(d.platform.get(k))) for k in PLATFORM_KEYS])
        single[PLATFORM.name] = PLATFORM.line(f"{base},{platform}", 1.0)
    lines = _Lines()
    for name in sorted(d.slots)[:MAX_SLOTS]:
        slot = d.slots[name]
        model = labels_text(
            [
                ("slot", _value(name)),
                ("model_id", _value(slot.get("model_id"))),
                ("version", _value(slot.get("version"))),
                ("sha256", _value(slot.get("sha256"))),
                ("state", _value(slot.get("state"))),
            ]
        )
        lines.add(MODEL, f"{base},{model}", 1.0)
        last = slot.get("last_failure")
        if isinstance(last, dict) and isinstance(last.get("ts"), (int, float)):
            code = last.get("error_code") or last.get("state")
            failure = labels_text([("slot", _value(name)), ("error_code", _value(code))])
            lines.add(FAILURE, f"{base},{failure}", float(last["ts"]))
    latest: dict[str, Any] = {}
    for seen in d.jobs:  # latest first: the first per slot is its latest job (at most MAX_JOBS)
        latest.setdefault(seen.slot, seen)
    for slot_name, seen in sorted(latest.items()):
        job = labels_text(
            [
                ("slot", _value(slot_name)),
                ("job_id", _value(seen.job_id)),
                ("state", seen.state),
                ("error_code", _value(seen.error_code)),
            ]
        )
        lines.add(JOB, f"{base},{job}", 1.0)
    return {**single, **lines.joined()}


def _telemetry_lines(
    figures: dict[str, float], at: float | None, stale: bool, dev: str
) -> tuple[dict[str, str], dict[str, FamilyHead]]:
    """A device's telemetry lines (none while it is stale, but its last telemetry time ``at``) and
    families. The path every telemetry message takes at the next scrape, so written out flat."""
    base = f'device="{dev}"'
    by_family: dict[str, list[str]] = {}
    heads: dict[str, FamilyHead] = {}
    if not stale:
        seen: set[str] = set()
        for name, value in figures.items():
            known = _figure(name)
            if known is None:
                continue
            head, rest, scale = known
            key = head.name + rest  # the series, within this device
            if key in seen:
                continue
            seen.add(key)
            line = f"{head.name}{{{base}{rest}}} {number(value * scale)}\n"
            chunk = by_family.get(head.name)
            if chunk is None:
                by_family[head.name] = [line]
                heads[head.name] = head
            else:
                chunk.append(line)
    lines = {name: "".join(chunk) for name, chunk in by_family.items()}
    if at is not None:
        lines[LAST_TELEMETRY.name] = LAST_TELEMETRY.line(base, at)
    return lines, heads


class FleetMetrics:
    """The fleet's exposition, each device's lines kept between scrapes (see the module docstring).

    :meth:`render` is safe to call from any thread; two scrapes at once take turns.
    """

    def __init__(
        self,
        view: FleetView,
        rollouts: Rollouts | None = None,
        rollout_counts: RolloutCounts | None = None,
        rollouts_mark: RolloutsMark | None = None,
    ) -> None:
        self.view = view
        self.rollouts = rollouts
        self.rollout_counts = rollout_counts
        self.rollouts_mark = rollouts_mark
        self._rollouts_kept: tuple[object, str] | None = None  # (mark, text) of the last read
        self._lock = threading.Lock()
        self._devices: dict[str, _Device] = {}
        self._order: list[str] = []
        # The last answer and what it was made of besides the devices (rollout text, refused count),
        # and its gzip: a scrape that finds nothing changed sends the same bytes.
        self._body: tuple[tuple[str, int], bytes] | None = None
        self._gzipped: tuple[bytes, bytes] | None = None
        self.rendered_devices = 0  # devices whose lines were redone (telemetry or all), for tests

    def render(self) -> bytes:
        """The exposition text (Prometheus text format 0.0.4), UTF-8."""
        with self._lock:
            return self._render()

    def render_gzip(self) -> bytes:
        """:meth:`render`, gzipped (level 1: for 11 MB of exposition ~10x faster than level 9)."""
        with self._lock:
            body = self._render()
            if self._gzipped is None or self._gzipped[0] is not body:
                self._gzipped = (body, gzip.compress(body, compresslevel=1))
            return self._gzipped[1]

    def _render(self) -> bytes:
        changed = self._refresh(self.view.changes())
        rest = (self._rollouts_text(), self.view.refused_devices)
        if not changed and self._body is not None and self._body[0] == rest:
            return self._body[1]
        # "replace": the protocol's JSON parser refuses lone surrogates, but a scrape must not fail.
        body = self._text(*rest).encode("utf-8", "replace")
        self._body = (rest, body)
        return body

    def _refresh(self, changes: dict[str, tuple[int, int, bool]]) -> bool:
        """Redo the lines of the devices that changed; False when none did (nor came or went)."""
        devices = self._devices
        moved = changes.keys() != devices.keys()
        redone = self.rendered_devices
        if moved:
            for gone in [d for d in devices if d not in changes]:
                del devices[gone]
        for device_id, mark in changes.items():
            kept = devices.get(device_id)
            if kept is not None and kept.mark == mark:
                continue
            if kept is not None and kept.mark[1:] == mark[1:]:  # new telemetry figures, nothing else
                telemetry = self.view.telemetry(device_id)
                if telemetry is None:  # forgotten since changes(): it goes at the next scrape
                    continue
                kept.telemetry, kept.heads = _telemetry_lines(*telemetry, mark[2], kept.dev)
                kept.mark = mark
                self.rendered_devices += 1
                continue
            state = self.view.device(device_id)
            if state is None:
                continue
            dev = escape(device_label(device_id))
            kept = devices[device_id] = _Device(
                mark, dev, state.state, _device_lines(state, dev), state.labels, state.agent_version
            )
            kept.telemetry, kept.heads = _telemetry_lines(
                state.telemetry, state.telemetry_at, state.stale, dev
            )
            self.rendered_devices += 1
        if moved or len(self._order) != len(devices):
            self._order = sorted(devices)
        return moved or self.rendered_devices != redone

    def _info_names(self) -> tuple[tuple[str, str], ...]:
        """(label name, label key) of the device labels on ``edge_device_info``, fleet-wide."""
        keys = Counter(k for d in self._order for k in self._devices[d].labels)
        names: dict[str, str] = {}
        for key in sorted(k for k, _ in keys.most_common(MAX_LABEL_KEYS)):
            names.setdefault(label_name(key), key)  # two keys mapping to one name: the first wins
        return tuple(names.items())

    def _info_line(self, device_id: str, kept: _Device, names: tuple[tuple[str, str], ...]) -> str:
        if kept.info_names != names:
            pairs = [("device", device_label(device_id)), ("agent_version", _value(kept.agent_version))]
            pairs += [(name, _value(kept.labels.get(key))) for name, key in names]
            kept.info_line, kept.info_names = INFO.line(labels_text(pairs), 1.0), names
        return kept.info_line

    def _text(self, rollouts: str, refused: int) -> str:
        devices = [self._devices[d] for d in self._order]
        parts: list[str] = []
        for head in _DEVICE_FAMILIES:
            parts.append(head.header())
            if head is INFO:
                names = self._info_names()
                parts += [self._info_line(d, self._devices[d], names) for d in self._order]
            elif head is LAST_TELEMETRY:
                parts += [d.telemetry.get(head.name, "") for d in devices]
            else:
                parts += [d.lines.get(head.name, "") for d in devices]
        heads: dict[str, FamilyHead] = {}
        for d in devices:
            heads.update(d.heads)
        for name in sorted(heads):
            parts.append(heads[name].header())
            parts += [d.telemetry.get(name, "") for d in devices]
        parts.append(rollouts)
        parts.append(FLEET.header())
        for state_name, count in sorted(Counter(d.state for d in devices).items()):
            parts.append(FLEET.line(labels_text([("state", state_name)]), count))
        parts.append(REFUSED.header())
        parts.append(REFUSED.line("", refused))
        return "".join(parts)

    def _rollouts_text(self) -> str:
        """The rollout series, read again only when the store's mark moved (read before the
        rollouts: a change while they are read moves it again, so the next scrape reads again)."""
        if self.rollouts is None:
            return ""
        mark = self.rollouts_mark() if self.rollouts_mark is not None else None
        if mark is not None and self._rollouts_kept is not None and self._rollouts_kept[0] == mark:
            return self._rollouts_kept[1]
        text = self._rollouts(self.rollouts())
        self._rollouts_kept = None if mark is None else (mark, text)
        return text

    def _rollouts(self, rows: Sequence[RolloutRow]) -> str:
        info: list[str] = [ROLLOUT.header()]
        counts: list[str] = [ROLLOUT_DEVICES.header()]
        for row in rows:
            labels = [
                ("rollout_id", row.rollout_id),
                ("slot", _value(row.slot)),
                ("to_version", _value(row.to_version)),
                ("state", row.state.value),
            ]
            info.append(ROLLOUT.line(labels_text(labels), 1.0))
            if self.rollout_counts is None:
                continue
            for wave, step, end, n in self.rollout_counts(row.rollout_id):
                # 1-based, as the CLI and the console count waves (the store counts from 0)
                pairs = [
                    ("rollout_id", row.rollout_id),
                    ("wave", str(wave + 1)),
                    ("step", step),
                    ("end", end),
                ]
                counts.append(ROLLOUT_DEVICES.line(labels_text(pairs), n))
        return "".join(info + counts)


def fleet_metrics(
    view: FleetView,
    rollouts: Rollouts | None = None,
    rollout_counts: RolloutCounts | None = None,
    rollouts_mark: RolloutsMark | None = None,
) -> FleetMetrics:
    """The fleet's ``/metrics`` content (hand it to :func:`metrics_asgi_app`); the rollouts, their
    device counts and the store's change mark usually come from one :class:`RolloutStore`."""
    return FleetMetrics(view, rollouts, rollout_counts, rollouts_mark)


def _answer(metrics: FleetMetrics, accept_encoding: str) -> tuple[bytes, list[tuple[str, str]]]:
    """The body and headers of one scrape: gzipped when the scraper accepts it (Prometheus does)."""
    headers = [("Content-Type", CONTENT_TYPE)]
    if "gzip" in accept_encoding:
        body = metrics.render_gzip()
        headers.append(("Content-Encoding", "gzip"))
    else:
        body = metrics.render()
    headers.append(("Content-Length", str(len(body))))
    return body, headers


def metrics_asgi_app(metrics: FleetMetrics) -> Any:
    """The ASGI app serving ``metrics`` (the console mounts it at ``/metrics``); it renders in a
    worker thread, so a scrape never blocks the console's event loop."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            return
        accept = ""
        for name, value in scope.get("headers", []):
            if name.lower() == b"accept-encoding":
                accept = value.decode("latin-1")
        body, headers = await asyncio.to_thread(_answer, metrics, accept)
        raw = [(k.lower().encode(), v.encode()) for k, v in headers]
        await send({"type": "http.response.start", "status": 200, "headers": raw})
        await send({"type": "http.response.body", "body": b"" if scope.get("method") == "HEAD" else body})

    return app


class MetricsServer:
    """``serve_metrics``'s result: the port it got and a :meth:`stop`."""

    def __init__(self, server: ThreadingHTTPServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread

    @property
    def port(self) -> int:
        return int(self._server.server_port)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)


def serve_metrics(
    view: FleetView,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    rollouts: Rollouts | None = None,
    rollout_counts: RolloutCounts | None = None,
    rollouts_mark: RolloutsMark | None = None,
) -> MetricsServer:
    """Serve the fleet's ``/metrics`` on ``host:port`` (0: a free port) in a daemon thread, no console."""
    metrics = fleet_metrics(view, rollouts, rollout_counts, rollouts_mark)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body, headers = _answer(metrics, self.headers.get("Accept-Encoding", ""))
            self.send_response(200)
            for name, value in headers:
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per scrape on stderr is noise

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="fleet-metrics", daemon=True)
    thread.start()
    return MetricsServer(server, thread)
