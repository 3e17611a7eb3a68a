"""The controller's ``/metrics``: the whole fleet as Prometheus series, from a :class:`FleetView`.

:class:`FleetMetrics` renders the exposition from the view (and, when given, the rollout store) at
scrape time, so nothing is kept twice and nothing drifts. The series (per device, per slot, per
rollout, the fleet's engines) and their bounds are listed in docs/operations.md: a device chooses
its id, labels, slots and figures, so what becomes a label is cut and counted
(:mod:`agent.fleet.metrics.device_series`). Each device's lines stay rendered between scrapes and
are redone only when :meth:`FleetView.changes` says the device moved, and the text is written
directly (:mod:`agent.fleet.metrics.text`) rather than through ``prometheus_client``'s collectors,
which format every sample at every scrape. :mod:`agent.fleet.metrics.serving` serves it.
"""

from __future__ import annotations

import gzip
import threading
from collections import Counter
from collections.abc import Callable, Sequence

from agent.fleet.metrics.device_series import (
    DEVICE_FAMILIES,
    INFO,
    LAST_TELEMETRY,
    KeptDevice,
    device_label,
    device_lines,
    label_name,
    label_value,
    telemetry_lines,
)
from agent.fleet.metrics.engine_series import EnginesFn, engine_lines
from agent.fleet.metrics.enroll_series import EnrollFn, enroll_lines
from agent.fleet.metrics.intake_series import IntakeFn, intake_lines
from agent.fleet.metrics.text import FamilyHead, escape, labels_text
from agent.fleet.rollout.records import OPERATOR_ABORT, RolloutRow, RolloutState, WaveRow
from agent.fleet.view.live import FleetView

#: Device label keys exported on ``edge_device_info`` (the most used first; a fleet with more keys
#: than this has them in the console and in selectors, not in Prometheus).
MAX_LABEL_KEYS = 32

Rollouts = Callable[[], Sequence[RolloutRow]]
#: A rollout's waves with their times: :meth:`RolloutStore.wave_rows`.
RolloutWaves = Callable[[str], Sequence[WaveRow]]
#: When anything of a rollout last moved: :meth:`RolloutStore.last_change`.
RolloutChanged = Callable[[str], "float | None"]
#: A rollout's device counts by (wave, step, end): :meth:`RolloutStore.device_counts`.
RolloutCounts = Callable[[str], Sequence[tuple[int, str, str, int]]]
#: Moves when the rollouts may have changed: :meth:`RolloutStore.change_mark`.
RolloutsMark = Callable[[], object]

ROLLOUT = FamilyHead("edge_rollout_info", "gauge", "A rollout and its state.")
ROLLOUT_DEVICES = FamilyHead(
    "edge_rollout_devices", "gauge", "Devices of a rollout by wave, controller step and job end."
)
WAVE_STARTED = FamilyHead(
    "edge_rollout_wave_started_timestamp_seconds", "gauge", "When a rollout's wave started, Unix seconds."
)
WAVE_ENDED = FamilyHead(
    "edge_rollout_wave_ended_timestamp_seconds", "gauge", "When a rollout's wave ended, Unix seconds."
)
LAST_CHANGE = FamilyHead(
    "edge_rollout_last_change_timestamp_seconds",
    "gauge",
    "When a device, wave or the state of a rollout last moved, Unix seconds.",
)
ABORTED = FamilyHead(
    "edge_rollout_aborted_info", "gauge", "An aborted rollout and who aborted it: operator, or gate."
)
FLEET = FamilyHead("edge_fleet_devices", "gauge", "Devices the controller has heard of, by state.")
REFUSED = FamilyHead(
    "edge_fleet_refused_devices_total",
    "counter",
    "Messages from devices the fleet view did not take: past its max_devices, or an id too long.",
)


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
        *,
        rollout_waves: RolloutWaves | None = None,
        rollout_changed: RolloutChanged | None = None,
        engines: EnginesFn | None = None,
        enrollment: EnrollFn | None = None,
        intake: IntakeFn | None = None,
    ) -> None:
        self.view = view
        self.intake = intake
        self.rollouts = rollouts
        self.rollout_counts = rollout_counts
        self.rollouts_mark = rollouts_mark
        self.rollout_waves = rollout_waves
        self.rollout_changed = rollout_changed
        self.engines = engines
        self.enrollment = enrollment
        self._rollouts_kept: tuple[object, str] | None = None  # (mark, text) of the last read
        self._lock = threading.Lock()
        self._devices: dict[str, KeptDevice] = {}
        self._order: list[str] = []
        # The last answer and what it was made of besides the devices (rollout text, refused count),
        # and its gzip: a scrape that finds nothing changed sends the same bytes.
        self._body: tuple[tuple[str, int], bytes] | None = None
        self._gzipped: tuple[bytes, bytes] | None = None
        self.rendered_devices = 0  # devices whose lines were redone (telemetry or all), for tests
        self._prepared = False  # prepare() redid lines since the last answer: the next one is new

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

    def prepare(self) -> None:
        """Render the devices that are new or changed other than by telemetry since the last scrape
        (:meth:`keep_warm` calls it between scrapes), so that no scrape renders a whole fleet."""
        with self._lock:
            self._prepared = self._refresh(self.view.changes(), telemetry=False) or self._prepared

    def keep_warm(self, every_s: float = 1.0) -> Callable[[], None]:
        """Call :meth:`prepare` in a daemon thread whenever the view moved, at most every ``every_s``
        seconds; returns the function that stops it.

        A scrape then renders at most ``every_s`` seconds of new devices, not a whole fleet's (the
        first scrape after a start), besides the telemetry lines of the devices that sent some.
        """
        stop = threading.Event()

        def run() -> None:
            seen = -1
            while not stop.is_set():
                now = self.view.wait_change(seen, every_s)
                if now != seen:
                    seen = now
                    self.prepare()
                stop.wait(every_s)

        threading.Thread(target=run, name="fleet-metrics-warm", daemon=True).start()
        return stop.set

    def _render(self) -> bytes:
        changed = self._refresh(self.view.changes()) or self._prepared
        self._prepared = False
        rest = (
            self._rollouts_text() + self._engines_text() + self._enroll_text() + self._intake_text(),
            self.view.refused_devices,
        )
        if not changed and self._body is not None and self._body[0] == rest:
            return self._body[1]
        # "replace": the protocol's JSON parser refuses lone surrogates, but a scrape must not fail.
        body = self._text(*rest).encode("utf-8", "replace")
        self._body = (rest, body)
        return body

    def _refresh(self, changes: dict[str, tuple[int, int, bool]], *, telemetry: bool = True) -> bool:
        """Redo the lines of the devices that changed; False when none did (nor came or went).

        ``telemetry`` False: leave the devices whose only change is new telemetry figures to the
        scrape (their lines are cheap to redo, and a fleet's telemetry moves all the time)."""
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
                figures = self.view.telemetry(device_id) if telemetry else None
                if figures is None:  # forgotten since changes() (it goes at the next scrape), or left
                    continue
                kept.telemetry, kept.heads = telemetry_lines(*figures, mark[2], kept.dev)
                kept.mark = mark
                self.rendered_devices += 1
                continue
            state = self.view.device(device_id)
            if state is None:
                continue
            dev = escape(device_label(device_id))
            kept = devices[device_id] = KeptDevice(
                mark, dev, state.state, device_lines(state, dev), state.labels, state.agent_version
            )
            kept.telemetry, kept.heads = telemetry_lines(
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

    def _info_line(self, device_id: str, kept: KeptDevice, names: tuple[tuple[str, str], ...]) -> str:
        if kept.info_names != names:
            pairs = [("device", device_label(device_id)), ("agent_version", label_value(kept.agent_version))]
            pairs += [(name, label_value(kept.labels.get(key))) for name, key in names]
            kept.info_line, kept.info_names = INFO.line(labels_text(pairs), 1.0), names
        return kept.info_line

    def _text(self, rollouts: str, refused: int) -> str:
        devices = [self._devices[d] for d in self._order]
        parts: list[str] = []
        for head in DEVICE_FAMILIES:
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

    def _engines_text(self) -> str:
        """The engine and claim series, read at every scrape (a claim's age moves by itself)."""
        return "" if self.engines is None else engine_lines(self.engines())

    def _enroll_text(self) -> str:
        """The enrollment desk's series, read at every scrape (its counters move on their own)."""
        return "" if self.enrollment is None else enroll_lines(self.enrollment())

    def _intake_text(self) -> str:
        """The controller's message counters, read at every scrape."""
        return "" if self.intake is None else intake_lines(self.intake())

    def _rollouts(self, rows: Sequence[RolloutRow]) -> str:
        info: list[str] = [ROLLOUT.header()]
        counts: list[str] = [ROLLOUT_DEVICES.header()]
        times: dict[FamilyHead, list[str]] = {
            h: [h.header()] for h in (WAVE_STARTED, WAVE_ENDED, LAST_CHANGE)
        }
        aborted: list[str] = [ABORTED.header()]
        for row in rows:
            rollout = [("rollout_id", row.rollout_id)]
            named = [*rollout, ("slot", label_value(row.slot)), ("to_version", label_value(row.to_version))]
            if row.state is RolloutState.ABORTED:
                by = "operator" if row.reason.startswith(OPERATOR_ABORT) else "gate"
                aborted.append(ABORTED.line(labels_text([*named, ("by", by)]), 1.0))
            changed = self.rollout_changed(row.rollout_id) if self.rollout_changed is not None else None
            if changed is not None:
                times[LAST_CHANGE].append(LAST_CHANGE.line(labels_text(named), changed))
            for stored in self.rollout_waves(row.rollout_id) if self.rollout_waves is not None else ():
                numbered = labels_text([*rollout, ("wave", str(stored.index + 1))])
                for head, at in ((WAVE_STARTED, stored.started_at), (WAVE_ENDED, stored.ended_at)):
                    if at is not None:
                        times[head].append(head.line(numbered, at))
            labels = [
                ("rollout_id", row.rollout_id),
                ("slot", label_value(row.slot)),
                ("to_version", label_value(row.to_version)),
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
        return "".join(info + counts + aborted + [line for lines in times.values() for line in lines])


def fleet_metrics(
    view: FleetView,
    rollouts: Rollouts | None = None,
    rollout_counts: RolloutCounts | None = None,
    rollouts_mark: RolloutsMark | None = None,
    *,
    rollout_waves: RolloutWaves | None = None,
    rollout_changed: RolloutChanged | None = None,
    engines: EnginesFn | None = None,
    enrollment: EnrollFn | None = None,
    intake: IntakeFn | None = None,
) -> FleetMetrics:
    """The fleet's ``/metrics`` content (hand it to :func:`metrics_asgi_app`); the rollouts, their
    device counts, waves, last change and the store's change mark usually come from one
    :class:`RolloutStore`, ``engines`` from the controller's engine desk, ``intake`` from its MQTT
    client and view."""
    return FleetMetrics(
        view,
        rollouts,
        rollout_counts,
        rollouts_mark,
        rollout_waves=rollout_waves,
        rollout_changed=rollout_changed,
        engines=engines,
        enrollment=enrollment,
        intake=intake,
    )
