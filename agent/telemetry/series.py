"""Telemetry figures as Prometheus series: which metric, which labels and which unit each dotted name becomes.

The device publishes flat dotted names (``stream.cam0.latency.total.p99_ms``, docs/operations.md);
Prometheus wants a metric name with its unit, counters ending in ``_total``, and what varies (the
stream, the stage, the quantile) in labels: ``edge_stream_latency_seconds{stream="cam0",
stage="total",quantile="0.99"} 0.0123``. :data:`RULES` is that translation, one line per field of
the telemetry table; :func:`series_of` applies it. It is pure (no ``prometheus_client`` here), so
the controller's fleet-wide ``/metrics`` (agent/fleet/metrics/exposition.py) and a device's own opt-in one
(agent/telemetry/prometheus.py) export the same names.

Names a device made up (a stream, slot or thermal zone) go into label values, never into metric
names, so one metric name holds every device. A field no rule knows is not exported (it stays in
``up/telemetry`` and the console): an unknown name cannot be given a unit or a type honestly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

#: Metric name prefix of everything the agent's figures become.
PREFIX = "edge_"
#: Longest label value taken from a telemetry name (a device may name a stream with 64 characters).
LABEL_VALUE_LIMIT = 128

Kind = Literal["gauge", "counter"]


@dataclass(frozen=True)
class Rule:
    """One dotted-name pattern (named groups become labels) and the metric it becomes."""

    pattern: re.Pattern[str]
    metric: str  # without PREFIX; a counter's ends in ``_total``
    kind: Kind
    help: str
    scale: float = 1.0  # what the value is multiplied by (ms -> s, MB -> bytes, MHz -> Hz)


@dataclass(frozen=True)
class Series:
    """Where one telemetry figure goes: metric, its kind and help, label pairs, value multiplier."""

    metric: str
    kind: Kind
    help: str
    labels: tuple[tuple[str, str], ...]
    scale: float


_N = r"(?P<{}>.+?)"  # a device-chosen name (may contain dots: Name allows them)
#: The groups that hold a name the device chose (a stream, a slot, a thermal zone).
CHOSEN_GROUPS = ("stream", "slot", "zone")
_QUANTILES = {"50": "0.5", "95": "0.95", "99": "0.99"}


def _rule(pattern: str, metric: str, kind: Kind, help_text: str, scale: float = 1.0) -> Rule:
    return Rule(
        re.compile(pattern.replace("{s}", _N.format("stream")).replace("{slot}", _N.format("slot"))),
        metric,
        kind,
        help_text,
        scale,
    )


#: A name a device chose may hold dots, so one dotted name can match more than one rule:
#: ``slot.cls.transitions.active`` is slot ``cls`` entering ``active`` (``slot_transitions``) or the
#: ``active`` flag of a slot named ``cls.transitions`` (``slot_active``). :func:`series_of` takes the
#: reading whose device-chosen names (:data:`CHOSEN_GROUPS`) are shortest, then the first rule; the
#: agent's own names are all read right that way (tests/e2e/test_metric_names.py checks every name a
#: real daemon sends).
RULES: tuple[Rule, ...] = (
    # -- streams --
    _rule(
        r"stream\.{s}\.fps",
        "stream_frames_per_second",
        "gauge",
        "Published frames per second over the last telemetry interval.",
    ),
    _rule(
        r"stream\.{s}\.frames_(?P<stage>captured|inferred|published)",
        "stream_frames_total",
        "counter",
        "Frames of the stream by stage, since the agent started.",
    ),
    _rule(
        r"stream\.{s}\.dropped\.(?P<reason>[^.]+)",
        "stream_dropped_frames_total",
        "counter",
        "Frames dropped, by reason (queue_full, fps_limit, no_model, infer_error, ...).",
    ),
    _rule(
        r"stream\.{s}\.latency\.(?P<stage>[^.]+)\.p(?P<quantile>50|95|99)_ms",
        "stream_latency_seconds",
        "gauge",
        "Latency percentiles per stage over the latest 2048 frames.",
        1e-3,
    ),
    _rule(
        r"stream\.{s}\.latency\.(?P<stage>[^.]+)\.count",
        "stream_latency_observations_total",
        "counter",
        "Frames timed per stage since the agent started.",
    ),
    _rule(
        r"stream\.{s}\.capture_fps",
        "stream_capture_frames_per_second",
        "gauge",
        "Frames per second the camera delivered over the last telemetry interval.",
    ),
    _rule(
        r"stream\.{s}\.source\.state",
        "stream_source_state",
        "gauge",
        "Camera source state code: 0 idle, 1 connecting, 2 streaming, 3 reconnecting, 4 ended, 5 stopped.",
    ),
    _rule(
        r"stream\.{s}\.source\.last_frame_age_s",
        "stream_source_last_frame_age_seconds",
        "gauge",
        "Seconds since the camera delivered its last frame (since the source started, before the first).",
    ),
    _rule(
        r"stream\.{s}\.source\.(?P<event>frames|reconnects|read_failures|open_failures|gaps|frames_missed)",
        "stream_source_events_total",
        "counter",
        "Camera source counters (frames read, reconnects, failures, gaps after a reconnect, frames missed).",
    ),
    _rule(
        r"stream\.{s}\.source\.gap_s",
        "stream_source_gap_seconds_total",
        "counter",
        "Seconds without frames across the camera source's reconnects.",
    ),
    # -- model slots --
    _rule(
        r"slot\.{slot}\.(?P<guard>shadow|probation)\.active",
        "slot_guard_active",
        "gauge",
        "1 while a shadow run or a probation watches the slot's new model.",
    ),
    _rule(
        r"slot\.{slot}\.(?P<guard>shadow|probation)\.(?P<figure>[^.]+)",
        "slot_guard_figure",
        "gauge",
        "A running shadow's or probation's figure (agreement, ratios, frames).",
    ),
    _rule(
        r"slot\.{slot}\.latency\.(?P<stage>[^.]+)\.p(?P<quantile>50|95|99)_ms",
        "slot_latency_seconds",
        "gauge",
        "Inference latency percentiles of the slot.",
        1e-3,
    ),
    _rule(
        r"slot\.{slot}\.latency\.(?P<stage>[^.]+)\.count",
        "slot_latency_observations_total",
        "counter",
        "Batches timed since the agent started.",
    ),
    _rule(r"slot\.{slot}\.batches", "slot_batches_total", "counter", "Batches inferred by the slot."),
    _rule(r"slot\.{slot}\.active", "slot_active", "gauge", "1 while the slot serves a model."),
    _rule(r"slot\.{slot}\.swaps", "slot_swaps_total", "counter", "Model swaps of the slot."),
    _rule(
        r"slot\.{slot}\.failed_loads", "slot_failed_loads_total", "counter", "Models the slot failed to load."
    ),
    _rule(r"slot\.{slot}\.swap_failures", "slot_swap_failures_total", "counter", "Swaps that failed."),
    _rule(
        r"slot\.{slot}\.transitions\.(?P<state>[^.]+)",
        "slot_transitions_total",
        "counter",
        "Slot state transitions, by the state entered.",
    ),
    _rule(
        r"slot\.{slot}\.queue\.(?P<queue>[^.]+)",
        "slot_queue_depth",
        "gauge",
        "Items waiting in the slot's frame-path queues.",
    ),
    # -- the MQTT link and the spool --
    _rule(r"mqtt\.connected", "mqtt_connected", "gauge", "1 while the device's MQTT link is connected."),
    _rule(
        r"mqtt\.session",
        "mqtt_session",
        "gauge",
        "The link's connection counter (persisted across restarts).",
    ),
    _rule(
        r"mqtt\.spool_depth",
        "mqtt_spool_depth_messages",
        "gauge",
        "Messages waiting in the spool to be sent.",
    ),
    _rule(
        r"mqtt\.inbox_depth", "mqtt_inbox_depth_messages", "gauge", "Received messages waiting to be handled."
    ),
    _rule(
        r"mqtt\.(?P<event>[^.]+)",
        "mqtt_events_total",
        "counter",
        "MQTT link counters (published, received, refused, reconnects, ...).",
    ),
    _rule(r"spool\.rows", "spool_rows", "gauge", "Messages held by the on-disk spool."),
    _rule(r"spool\.bytes", "spool_bytes", "gauge", "Bytes held by the on-disk spool."),
    _rule(r"spool\.max_rows", "spool_max_rows", "gauge", "The spool's cap in messages (spool.max_rows)."),
    _rule(r"spool\.max_bytes", "spool_max_bytes", "gauge", "The spool's cap in bytes (spool.max_bytes)."),
    _rule(r"spool\.write_failing", "spool_write_failing", "gauge", "1 while spool writes fail (full disk)."),
    _rule(
        r"spool\.(?P<event>[^.]+)",
        "spool_events_total",
        "counter",
        "Spool counters: evicted, dropped_at_cap, expired, dropped_write_failed, ...",
    ),
    # -- the fleet root of trust (docs/trust.md), only on a device with delivery.trust_root --
    _rule(
        r"trust\.root_version",
        "trust_root_version",
        "gauge",
        "The version of the fleet root the device holds.",
    ),
    _rule(
        r"trust\.root_expired",
        "trust_root_expired",
        "gauge",
        "1 once the device's fleet root expired: it keeps serving and refuses new deployments.",
    ),
    _rule(
        r"trust\.root_expires_in_s",
        "trust_root_expires_in_seconds",
        "gauge",
        "Seconds until the device's fleet root expires (negative once it has).",
    ),
    _rule(
        r"cert\.days_to_expiry",
        "certificate_days_to_expiry",
        "gauge",
        "Days until the client certificate the device connects with expires.",
    ),
    _rule(
        r"cert\.(?P<event>[^.]+)",
        "certificate_renewal_events_total",
        "counter",
        "Certificate renewal counters: requests, renewed, refused, unanswered, failed, foreign_replies.",
    ),
    _rule(
        r"commands\.(?P<outcome>[^.]+)",
        "commands_total",
        "counter",
        "Commands on down/cmd by outcome: served, failed, refused, busy.",
    ),
    # -- the process and the system --
    _rule(
        r"process\.cpu_percent",
        "process_cpu_percent",
        "gauge",
        "CPU used by the agent process, percent of one core.",
    ),
    _rule(
        r"process\.rss_mb",
        "process_resident_memory_bytes",
        "gauge",
        "Resident memory of the agent process.",
        1024.0 * 1024.0,
    ),
    _rule(r"process\.threads", "process_threads", "gauge", "Threads of the agent process."),
    _rule(r"cpu\.percent", "cpu_percent", "gauge", "CPU used by the whole system, percent."),
    _rule(
        r"memory\.used_mb",
        "memory_used_bytes",
        "gauge",
        "System memory in use (total - available).",
        1024.0 * 1024.0,
    ),
    _rule(
        r"memory\.available_mb",
        "memory_available_bytes",
        "gauge",
        "System memory available.",
        1024.0 * 1024.0,
    ),
    _rule(r"memory\.percent", "memory_used_percent", "gauge", "System memory in use, percent."),
    _rule(r"temp\.(?P<zone>.+)_c", "temperature_celsius", "gauge", "Thermal zone temperature, by zone type."),
    _rule(
        r"(?P<unit>gpu|emc)\.load_percent",
        "load_percent",
        "gauge",
        "Jetson GPU or memory controller (EMC) load, percent.",
    ),
    _rule(
        r"(?P<clock>gpu|emc|dla0|dla1)\.freq_mhz",
        "clock_hertz",
        "gauge",
        "Jetson clock frequency (a drop under load means throttling).",
        1e6,
    ),
)

#: Names already looked up (the same few hundred names repeat for every device and every scrape).
_CACHE: dict[str, Series | None] = {}
_CACHE_LIMIT = 100_000


def series_of(name: str) -> Series | None:
    """Where the telemetry figure ``name`` goes, or None when no rule knows it (see :data:`RULES`)."""
    try:
        return _CACHE[name]
    except KeyError:
        pass
    found = None
    best: tuple[int, Rule, re.Match[str]] | None = None
    for rule in RULES:
        match = rule.pattern.fullmatch(name)
        if match is None:
            continue
        groups = match.groupdict()
        chosen = sum(len(groups[g] or "") for g in CHOSEN_GROUPS if g in groups)
        if best is None or chosen < best[0]:
            best = (chosen, rule, match)
    if best is not None:
        _, rule, match = best
        labels = tuple(
            (key, _QUANTILES[value] if key == "quantile" else value[:LABEL_VALUE_LIMIT])
            for key, value in match.groupdict().items()
        )
        found = Series(PREFIX + rule.metric, rule.kind, rule.help, labels, rule.scale)
    if len(_CACHE) >= _CACHE_LIMIT:
        _CACHE.clear()  # a device inventing names forever must not grow memory forever
    _CACHE[name] = found
    return found


@dataclass
class Family:
    """One metric's samples gathered from one or more devices' figures (plain data)."""

    name: str
    kind: Kind
    help: str
    label_names: tuple[str, ...]
    samples: list[tuple[tuple[str, ...], float]]


def gather(
    families: dict[str, Family], figures: dict[str, float], base: tuple[tuple[str, str], ...] = ()
) -> None:
    """Add every known figure of ``figures`` to ``families``, with the ``base`` labels in front.

    A metric keeps the label names of its first sample; a figure whose labels would differ (it
    cannot happen with :data:`RULES`, where each metric has one pattern) is left out.
    """
    for name, value in figures.items():
        found = series_of(name)
        if found is None:
            continue
        labels = base + found.labels
        names = tuple(k for k, _ in labels)
        family = families.get(found.metric)
        if family is None:
            family = families[found.metric] = Family(found.metric, found.kind, found.help, names, [])
        elif family.label_names != names:
            continue
        family.samples.append((tuple(v for _, v in labels), value * found.scale))
