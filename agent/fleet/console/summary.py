"""What the console shows, as JSON-ready dicts: pure functions of :class:`FleetView` copies.

A device row (the devices table and the live feed) is compact on purpose: with 1,000 devices the
page receives every row once and then only the rows that changed, so each row carries the few
figures the table shows, not the device's whole telemetry. The device page asks for everything
(:func:`device_detail`) when its device changes.

Every string here came from a device and is untrusted: :class:`~agent.fleet.view.live.FleetView` has cut
each one to a bounded length already, and the page puts them into the document as text nodes only
(``static/console.js``), never as markup.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.fleet.devices.selector import DeviceFacts, Selector, SelectorError, parse_selector
from agent.fleet.view.build_note import build_note
from agent.fleet.view.cameras import camera_down, camera_rows
from agent.fleet.view.chart_history import CHARTED, TelemetryPoint, chart_figures
from agent.fleet.view.device_record import JobSeen
from agent.fleet.view.live import DeviceState

#: The device states a filter may ask for (``stale``: online but silent, see FleetView).
STATES = ("online", "offline", "unknown", "stale")
#: Jobs listed on a device page (FleetView keeps at most 20).
JOBS_SHOWN = 20


@dataclass(frozen=True)
class DeviceFilter:
    """Which devices the table lists: all of ``selector`` (a ``--select`` text), ``state``, ``model``.

    ``model`` matches a device when one of its slots serves that model: ``MODEL_ID``, ``VERSION`` or
    ``MODEL_ID:VERSION`` (exactly, as the table's model column spells it).
    """

    selector: Selector | None = None
    state: str | None = None
    model: str | None = None

    @classmethod
    def parse(cls, params: Mapping[str, str]) -> DeviceFilter:
        """From query parameters ``select``, ``state``, ``model``; a :class:`SelectorError` or
        ValueError (an unknown state) names what is wrong. Empty parameters mean no filter."""
        text = params.get("select", "").strip()
        state = params.get("state", "").strip() or None
        if state is not None and state not in STATES:
            raise ValueError(f"state={state!r}: expected one of {', '.join(STATES)}")
        try:
            selector = parse_selector(text) if text else None
        except SelectorError as exc:  # its text names the CLI's flag; the page's field is "Selector"
            raise ValueError(f"selector: at column {exc.column}: {exc.what}") from exc
        return cls(selector, state, params.get("model", "").strip() or None)

    def matches(self, device: DeviceState) -> bool:
        """Whether ``device`` is listed under this filter."""
        if self.state is not None and _shown_state(device) != self.state:
            return False
        if self.model is not None and self.model not in _model_names(device.slots):
            return False
        if self.selector is not None:
            facts = DeviceFacts(device.device, device.labels, device.platform, device.agent_version)
            return self.selector.matches(facts)
        return True


def _shown_state(device: DeviceState) -> str:
    """``stale`` for an online device that went silent; its status otherwise."""
    return "stale" if device.state == "online" and device.stale else device.state


def _model_names(slots: Mapping[str, Mapping[str, Any]]) -> set[str]:
    names: set[str] = set()
    for slot in slots.values():
        model_id, version = slot.get("model_id"), slot.get("version")
        if model_id:
            names.add(str(model_id))
            if version:
                names.update({str(version), f"{model_id}:{version}"})
    return names


def stream_figures(figures: Mapping[str, float]) -> dict[str, float | None]:
    """The charted figures of one telemetry sample: :func:`agent.fleet.view.chart_history.chart_figures`."""
    return chart_figures(figures)


def device_row(device: DeviceState) -> dict[str, Any]:
    """One line of the devices table (and of the live feed)."""
    figures = stream_figures(device.telemetry)
    last = device.jobs[0] if device.jobs else None
    return {
        "id": device.device,
        "state": _shown_state(device),
        "since": device.since,
        "session": device.session,
        "agent": device.agent_version,
        "labels": device.labels,
        "models": {
            name: _model_cell(slot) for name, slot in sorted(device.slots.items()) if isinstance(slot, dict)
        },
        "fps": figures["fps"],
        "p99_ms": figures["p99_ms"],
        "cpu": device.telemetry.get("cpu.percent"),
        "temp_c": figures["temp_c"],
        "cameras": len(device.cameras),
        "cameras_down": sum(camera_down(camera) for camera in device.cameras.values()),
        "job": None if last is None else {"slot": last.slot, "state": last.state, "code": last.error_code},
        # The configuration and agent release it runs, what is pending, what was put back.
        "config": device.targets.get("config"),
        "release": device.targets.get("agent"),
        "problems": len(device.problems),
    }


def _model_cell(slot: Mapping[str, Any]) -> str:
    """``mobilenet:4``; an empty slot shows its state (``empty``)."""
    if not slot.get("model_id"):
        return str(slot.get("state") or "empty")
    return f"{slot['model_id']}:{slot.get('version') or '-'}"


def device_rows(devices: Iterable[DeviceState], where: DeviceFilter) -> dict[str, dict[str, Any]]:
    """The rows of the devices ``where`` lists, by device id (in id order)."""
    return {d.device: device_row(d) for d in devices if where.matches(d)}


def _job(job: JobSeen) -> dict[str, Any]:
    return {
        "job_id": job.job_id,
        "slot": job.slot,
        "state": job.state,
        "at": job.at,
        "error_code": job.error_code,
        "error": job.error,
        "shadow": job.shadow,
        "probation": job.probation,
        "build": build_note(job.build) or None,  # while BUILDING: phase, frames, elapsed, estimate
    }


def history_columns(points: Iterable[TelemetryPoint]) -> dict[str, list[float | None]]:
    """The charts' data as columns (what uPlot takes): ``ts`` and one list per charted figure."""
    columns: dict[str, list[float | None]] = {"ts": [], **{name: [] for name in CHARTED}}
    for point in points:
        columns["ts"].append(point.ts)
        for name in CHARTED:
            columns[name].append(point.figures[name])
    return columns


def device_detail(
    device: DeviceState, history: Iterable[TelemetryPoint], history_since: float | None = None
) -> dict[str, Any]:
    """Everything the device page shows: the row, slots, cameras, platform, temperatures, jobs, the charts.

    ``history_since``: since when the charts can hold data (a restarted controller's start, when
    that is less than an hour ago: the page says so).
    """
    return {
        "row": device_row(device),
        "stale": device.stale,
        "telemetry_at": device.telemetry_at,
        "platform": device.platform,
        "cert_not_after": device.cert_not_after,
        "slots": device.slots,
        "cameras": camera_rows(device.cameras, device.telemetry),
        "temperatures": {
            k.removeprefix("temp.").removesuffix("_c"): v
            for k, v in sorted(device.telemetry.items())
            if k.startswith("temp.") and k.endswith("_c")
        },
        "telemetry": dict(sorted(device.telemetry.items())),
        "jobs": [_job(j) for j in device.jobs[:JOBS_SHOWN]],
        "problems": list(device.problems),
        "history": history_columns(history),
        "history_since": history_since,
    }
