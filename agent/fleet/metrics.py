"""The controller's ``/metrics``: the whole fleet as Prometheus series, from a :class:`FleetView`.

A ``prometheus_client`` custom collector builds the exposition at scrape time from the view (and,
when given, the rollout store), so nothing is kept twice and nothing drifts. What it exports:

- per device, from ``up/status`` and ``up/info`` (always, stale or not): ``edge_device_online``
  (1/0), ``edge_device_stale``, ``edge_device_session``, ``edge_device_info{device, agent_version,
  <each device label>} 1`` (join it with ``* on(device) group_left(site)``), ``edge_device_platform_info``,
  ``edge_slot_model_info{device, slot, model_id, version, sha256, state} 1``, the latest job of each
  slot as ``edge_slot_job_info{..., job_id, state, error_code} 1``,
  ``edge_slot_last_failure_timestamp_seconds``, ``edge_device_last_telemetry_timestamp_seconds``
  and ``edge_device_malformed_messages``;
- per device, from its latest ``up/telemetry``, every figure :mod:`agent.telemetry.series` knows
  (fps, latency percentiles, drops by reason, spool depth, CPU, RSS, temperatures, GPU/DLA load and
  clocks), each with a ``device`` label. A STALE device (offline, or silent for ``stale_after_s``)
  has these series left out, so Prometheus marks them stale rather than charting frozen values;
- per rollout: ``edge_rollout_info{rollout_id, slot, to_version, state} 1`` and
  ``edge_rollout_devices{rollout_id, wave, step, end}`` (device counts);
- ``edge_fleet_devices`` and ``edge_fleet_refused_devices_total`` (devices past the view's cap).

Label values a device chose are cut to :data:`~agent.telemetry.series.LABEL_VALUE_LIMIT` characters
(the exposition format escapes quotes and newlines itself). Device label keys become label names
after replacing what Prometheus does not allow (``example.com/site`` -> ``example_com_site``); a key
that would collide with a label of ours gets a ``label_`` prefix; at most :data:`MAX_LABEL_KEYS`.

:func:`metrics_registry` gives a registry of its own, for ``prometheus_client.make_asgi_app`` (the
console mounts it at ``/metrics``) or :func:`serve_metrics` (a plain HTTP server, no console).
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, make_asgi_app, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from agent.fleet.rollout_store import DeviceRow, RolloutRow
from agent.fleet.view import DeviceState, FleetView
from agent.telemetry.prometheus import to_metrics
from agent.telemetry.series import LABEL_VALUE_LIMIT, Family, gather

#: Device label keys exported on ``edge_device_info`` (the most used first; a fleet with more keys
#: than this has them in the console and in selectors, not in Prometheus).
MAX_LABEL_KEYS = 32
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

Rollouts = Callable[[], Sequence[RolloutRow]]
RolloutDevices = Callable[[str], Sequence[DeviceRow]]


def _value(text: object) -> str:
    return "" if text is None else str(text)[:LABEL_VALUE_LIMIT]


def label_name(key: str) -> str:
    """A device label key as a Prometheus label name (``example.com/site`` -> ``example_com_site``)."""
    name = _BAD_LABEL_CHARS.sub("_", key)
    if name in _OURS or name.startswith("__") or name[:1].isdigit():
        name = f"label_{name}"
    return name


class FleetCollector(Collector):
    """Builds the fleet's exposition from the view at every scrape (see the module docstring)."""

    def __init__(
        self,
        view: FleetView,
        rollouts: Rollouts | None = None,
        rollout_devices: RolloutDevices | None = None,
    ) -> None:
        self.view = view
        self.rollouts = rollouts
        self.rollout_devices = rollout_devices

    def collect(self) -> Iterator[Metric]:
        devices = self.view.devices()
        yield from self._status(devices)
        yield from self._info(devices)
        yield from self._slots(devices)
        families: dict[str, Family] = {}
        for state in devices:
            if not state.stale:
                gather(families, state.telemetry, (("device", state.device),))
        yield from to_metrics(families.values())
        if self.rollouts is not None:
            yield from self._rollouts(self.rollouts())
        fleet = GaugeMetricFamily(
            "edge_fleet_devices", "Devices the controller has heard of, by state.", labels=["state"]
        )
        for state_name, count in sorted(Counter(d.state for d in devices).items()):
            fleet.add_metric([state_name], count)
        yield fleet
        yield CounterMetricFamily(
            "edge_fleet_refused_devices",
            "Messages from devices past the fleet view's max_devices (not tracked).",
            value=self.view.refused_devices,
        )

    def _status(self, devices: list[DeviceState]) -> Iterator[Metric]:
        online = GaugeMetricFamily(
            "edge_device_online", "1 while the device's retained status says online.", labels=["device"]
        )
        stale = GaugeMetricFamily(
            "edge_device_stale",
            "1 when the device is offline or sent no telemetry for stale_after_s.",
            labels=["device"],
        )
        session = GaugeMetricFamily(
            "edge_device_session", "The device's connection counter.", labels=["device"]
        )
        last = GaugeMetricFamily(
            "edge_device_last_telemetry_timestamp_seconds",
            "When the controller last heard the device's telemetry.",
            labels=["device"],
        )
        problems = GaugeMetricFamily(
            "edge_device_malformed_messages",
            "Malformed messages from the device kept by the controller (capped).",
            labels=["device"],
        )
        for d in devices:
            online.add_metric([d.device], 1.0 if d.state == "online" else 0.0)
            stale.add_metric([d.device], 1.0 if d.stale else 0.0)
            if d.session is not None:
                session.add_metric([d.device], d.session)
            if d.telemetry_at is not None:
                last.add_metric([d.device], d.telemetry_at)
            problems.add_metric([d.device], len(d.problems))
        yield from (online, stale, session, last, problems)

    def _info(self, devices: list[DeviceState]) -> Iterator[Metric]:
        keys = Counter(k for d in devices for k in d.labels)
        chosen = sorted(k for k, _ in keys.most_common(MAX_LABEL_KEYS))
        names: dict[str, str] = {}
        for key in chosen:
            names.setdefault(label_name(key), key)  # two keys mapping to one name: the first wins
        info = InfoMetricFamily(
            "edge_device",
            "The device's agent version and labels (join on device).",
            labels=["device", "agent_version", *names],
        )
        platform = InfoMetricFamily(
            "edge_device_platform",
            "What the device runs on (from up/info).",
            labels=["device", *PLATFORM_KEYS],
        )
        for d in devices:
            labels = [d.device, _value(d.agent_version)]
            info.add_metric(labels, {name: _value(d.labels.get(key)) for name, key in names.items()})
            if d.platform:
                platform.add_metric([d.device], {k: _value(d.platform.get(k)) for k in PLATFORM_KEYS})
        yield from (info, platform)

    def _slots(self, devices: list[DeviceState]) -> Iterator[Metric]:
        model = InfoMetricFamily(
            "edge_slot_model",
            "The model a slot serves (from up/info).",
            labels=["device", "slot", "model_id", "version", "sha256", "state"],
        )
        job = InfoMetricFamily(
            "edge_slot_job",
            "The latest job heard for the slot (up/jobs).",
            labels=["device", "slot", "job_id", "state", "error_code"],
        )
        failure = GaugeMetricFamily(
            "edge_slot_last_failure_timestamp_seconds",
            "When the slot's last failed job ended, by its error code.",
            labels=["device", "slot", "error_code"],
        )
        for d in devices:
            for name, slot in sorted(d.slots.items()):
                model.add_metric(
                    [
                        d.device,
                        _value(name),
                        _value(slot.get("model_id")),
                        _value(slot.get("version")),
                        _value(slot.get("sha256")),
                        _value(slot.get("state")),
                    ],
                    {},
                )
                last = slot.get("last_failure")
                if isinstance(last, dict) and isinstance(last.get("ts"), (int, float)):
                    code = last.get("error_code") or last.get("state")
                    failure.add_metric([d.device, _value(name), _value(code)], float(last["ts"]))
            latest: dict[str, Any] = {}
            for seen in d.jobs:  # latest first: the first per slot is its latest job
                latest.setdefault(seen.slot, seen)
            for slot_name, seen in sorted(latest.items()):
                job.add_metric(
                    [d.device, _value(slot_name), _value(seen.job_id), seen.state, _value(seen.error_code)],
                    {},
                )
        yield from (model, job, failure)

    def _rollouts(self, rows: Sequence[RolloutRow]) -> Iterator[Metric]:
        info = InfoMetricFamily(
            "edge_rollout", "A rollout and its state.", labels=["rollout_id", "slot", "to_version", "state"]
        )
        counts = GaugeMetricFamily(
            "edge_rollout_devices",
            "Devices of a rollout by wave, controller step and job end.",
            labels=["rollout_id", "wave", "step", "end"],
        )
        for row in rows:
            info.add_metric([row.rollout_id, _value(row.slot), _value(row.to_version), row.state.value], {})
            if self.rollout_devices is None:
                continue
            tally = Counter(
                # 1-based, as the CLI and the console count waves (issue 22.6)
                (str(d.wave + 1), d.step.value, d.end.value if d.end is not None else "")
                for d in self.rollout_devices(row.rollout_id)
            )
            for (wave, step, end), n in sorted(tally.items()):
                counts.add_metric([row.rollout_id, wave, step, end], n)
        yield from (info, counts)


def metrics_registry(
    view: FleetView, rollouts: Rollouts | None = None, rollout_devices: RolloutDevices | None = None
) -> CollectorRegistry:
    """A registry of its own holding the fleet collector (nothing of the process-wide default one)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(view, rollouts, rollout_devices))
    return registry


def metrics_asgi_app(registry: CollectorRegistry) -> Any:
    """The ASGI app serving ``registry`` (the console mounts it at ``/metrics``)."""
    return make_asgi_app(registry)


class MetricsServer:
    """``serve_metrics``'s result: the port it got and a :meth:`stop`."""

    def __init__(self, server: Any, thread: threading.Thread) -> None:
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
    rollout_devices: RolloutDevices | None = None,
) -> MetricsServer:
    """Serve the fleet's ``/metrics`` on ``host:port`` (0: a free port) in a daemon thread, no console."""
    server, thread = start_http_server(port, host, metrics_registry(view, rollouts, rollout_devices))
    return MetricsServer(server, thread)
