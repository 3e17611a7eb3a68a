"""The controller's ``/metrics``: the whole fleet as Prometheus series, from a :class:`FleetView`.

:class:`FleetMetrics` renders the exposition from the view (and, when given, the rollout store), so
nothing is kept twice and nothing drifts. The series (per device, per slot, per rollout, the fleet's
engines) and their bounds are listed in docs/operations.md: a device chooses its id, labels, slots
and figures, so what becomes a label is cut and counted (:mod:`agent.fleet.metrics.device_series`).
Each device's lines stay rendered between scrapes as bytes (:mod:`agent.fleet.metrics.kept_fleet`)
and are redone only when :meth:`FleetView.changes` says the device moved; kept warm
(:meth:`FleetMetrics.keep_warm`), they are redone between scrapes, so a scrape joins bytes and
gzips, and a periodic scraper's answer is built just before its scrape is due
(:mod:`agent.fleet.metrics.scrape_cadence`). The text is written directly
(:mod:`agent.fleet.metrics.text`) rather than through ``prometheus_client``'s collectors, which
format every sample at every scrape. :mod:`agent.fleet.metrics.serving` serves it.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from agent.fleet.metrics.device_series import label_value
from agent.fleet.metrics.engine_series import EnginesFn, engine_lines
from agent.fleet.metrics.enroll_series import EnrollFn, enroll_lines
from agent.fleet.metrics.intake_series import IntakeFn, intake_lines
from agent.fleet.metrics.kept_fleet import KeptFleet
from agent.fleet.metrics.scrape_cadence import ScrapeCadence
from agent.fleet.metrics.text import FamilyHead, as_bytes, labels_text
from agent.fleet.rollout.records import OPERATOR_ABORT, RolloutRow, RolloutState, WaveRow
from agent.fleet.view.live import FleetView

#: Devices a scrape renders itself while :meth:`FleetMetrics.keep_warm` runs (a whole fleet arriving
#: at a start is the warm pass's; a scrape of 10,000 devices renders in well under a second).
SCRAPE_RENDERS = 500
#: Devices the warm pass renders before it lets a waiting scrape take the lock.
WARM_BATCH = 200
#: The warm pass redoes a device's telemetry lines at most this often (a scrape redoes them as new
#: as they are): what a fleet sending faster than this costs the warm pass stays bounded.
WARM_TELEMETRY_EVERY_S = 5.0
#: Seconds before a periodic scraper's next scrape that the warm thread builds the answer (its
#: figures are that much older than the view's; Prometheus' own timestamps are the scrape's).
AHEAD_S = 1.0
#: The oldest answer built ahead that a scrape still sends (else it builds its own).
AHEAD_FRESH_S = 2 * AHEAD_S

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
        clock: Callable[[], float] = time.monotonic,
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
        self._fleet = KeptFleet(view, clock)
        # The last answer and what it was made of besides the devices (rollout text, refused count),
        # and its gzip: a scrape that finds nothing changed sends the same bytes.
        self._body: tuple[tuple[str, int], bytes] | None = None
        self._gzipped: tuple[bytes, bytes] | None = None
        self._moved = False  # the warm pass redid lines since the last answer: the next one is new
        self._warm = False  # keep_warm() runs: a scrape leaves what is over its budget to it
        # Scrapes waiting for the lock: the warm pass lets them in between two of its batches.
        self._turns = threading.Condition()
        self._waiting = 0
        self._clock = clock
        self._cadence = ScrapeCadence()
        self._ahead: tuple[float, bytes] | None = None  # an answer built ahead: (clock when, body)

    @property
    def rendered_devices(self) -> int:
        """Devices whose lines were redone (telemetry or all) since the start, for tests."""
        return self._fleet.rendered

    def render(self) -> bytes:
        """The exposition text (Prometheus text format 0.0.4), UTF-8: the view as it is now, or
        kept warm the answer built ahead for a periodic scraper (:meth:`keep_warm`)."""
        return self._answer(gzipped=False)

    def render_gzip(self) -> bytes:
        """:meth:`render`, gzipped (level 1: for 11 MB of exposition ~10x faster than level 9)."""
        return self._answer(gzipped=True)

    def answer_due(self) -> float | None:
        """When to build the next answer ahead (:meth:`prepare_answer`): :data:`AHEAD_S` before a
        periodic scraper's next scrape is due, on ``clock``; None when none is due or it is built."""
        with self._lock:
            due, last = self._cadence.next_due(), self._cadence.last
            if due is None or last is None or (self._ahead is not None and self._ahead[0] >= last):
                return None
            return due - AHEAD_S

    def prepare_answer(self) -> None:
        """Build the next answer now, gzipped too: the next scrape sends it if it comes within
        :data:`AHEAD_FRESH_S` (the warm thread calls this :data:`AHEAD_S` before a periodic
        scraper's next scrape, so that scrape joins and compresses nothing)."""
        self.prepare()
        with self._lock:
            built_at = self._clock()
            body = self._render()
            self._gzip(body)
            self._ahead = (built_at, body)

    def prepare(self) -> None:
        """Redo the lines of every device that moved since they were rendered, new telemetry
        included (:meth:`keep_warm` calls it between scrapes), in batches of :data:`WARM_BATCH`
        devices that let a waiting scrape in between them."""
        changes = self.view.changes()
        with self._lock:
            self._moved = self._fleet.forget_gone(changes) or self._moved
            pending = self._fleet.pending(changes)
        for start in range(0, len(pending), WARM_BATCH):
            self._give_way()
            with self._lock:
                for device_id, mark in pending[start : start + WARM_BATCH]:
                    redone = self._fleet.render(
                        device_id, mark, older_only=True, telemetry_every_s=WARM_TELEMETRY_EVERY_S
                    )
                    self._moved = redone or self._moved
        with self._lock:
            self._fleet.settle()

    def keep_warm(self, every_s: float = 1.0) -> Callable[[], None]:
        """Call :meth:`prepare` in a daemon thread every ``every_s`` seconds (devices also turn
        stale by the clock alone), and :meth:`prepare_answer` when :meth:`answer_due` says; returns
        the function that stops it.

        A scrape then finds few devices to render: those that moved since the last pass, and those
        whose telemetry moved since the warm pass last redid it (at most every
        :data:`WARM_TELEMETRY_EVERY_S`). It renders at most :data:`SCRAPE_RENDERS` devices itself
        (the first scrape after a start, while a whole fleet arrives, finds thousands): the rest show
        at the next scrape, rendered by this thread. A scraper that keeps a period (Prometheus)
        finds its answer built and gzipped, its figures at most :data:`AHEAD_FRESH_S` old.
        """
        stop = threading.Event()
        self._warm = True

        def run() -> None:
            while not stop.is_set():
                due = self.answer_due()
                if due is not None and due <= self._clock():
                    self.prepare_answer()
                else:
                    self.prepare()  # also when nothing arrived: devices turn stale by the clock alone
                due = self.answer_due()
                stop.wait(every_s if due is None else min(every_s, max(0.0, due - self._clock())))

        def stopped() -> None:
            self._warm = False
            stop.set()

        threading.Thread(target=run, name="fleet-metrics-warm", daemon=True).start()
        return stopped

    @contextmanager
    def _scrape_turn(self) -> Iterator[None]:
        """Hold the lock for a scrape, ahead of the warm pass's next batch."""
        with self._turns:
            self._waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._turns:
                self._waiting -= 1
                self._turns.notify_all()
        try:
            yield
        finally:
            self._lock.release()

    def _give_way(self) -> None:
        """Wait until no scrape waits for the lock (a scrape holds it for well under a second)."""
        with self._turns:
            self._turns.wait_for(lambda: self._waiting == 0, timeout=5.0)

    def _answer(self, *, gzipped: bool) -> bytes:
        with self._scrape_turn():
            now = self._clock()
            self._cadence.scraped(now)
            ahead, self._ahead = self._ahead, None
            body = ahead[1] if ahead is not None and now - ahead[0] <= AHEAD_FRESH_S else self._render()
            return self._gzip(body) if gzipped else body

    def _gzip(self, body: bytes) -> bytes:
        if self._gzipped is None or self._gzipped[0] is not body:
            # mtime 0: zlib writes the gzip header and trailer itself, in the one pass
            self._gzipped = (body, gzip.compress(body, compresslevel=1, mtime=0))
        return self._gzipped[1]

    def _render(self) -> bytes:
        changes = self.view.changes()
        fleet = self._fleet
        moved = fleet.forget_gone(changes) or self._moved
        self._moved = False
        pending = fleet.pending(changes)
        if self._warm:
            pending = pending[:SCRAPE_RENDERS]
        for device_id, mark in pending:
            moved = fleet.render(device_id, mark) or moved
        rest = (
            self._rollouts_text() + self._engines_text() + self._enroll_text() + self._intake_text(),
            self.view.refused_devices,
        )
        if not moved and self._body is not None and self._body[0] == rest:
            return self._body[1]
        parts = fleet.lines()
        parts.append(as_bytes(self._fleet_text(*rest)))
        body = b"".join(parts)
        self._body = (rest, body)
        return body

    def _fleet_text(self, rollouts: str, refused: int) -> str:
        """The rollout series and the fleet's counts, after the devices' families."""
        parts = [rollouts, FLEET.header()]
        for state_name, count in sorted(self._fleet.states().items()):
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
