"""A camera source: a driver wrapped in a state machine that reconnects with backoff.

States and the only transitions allowed between them (:data:`ALLOWED`)::

    IDLE ─► CONNECTING ─► STREAMING ─► ENDED          (file played once, synthetic frame limit)
              │   ▲          │
              ▼   │          ▼
            RECONNECTING ◄───┘                         (open or read failed: backoff, reopen)
    any non-terminal state ─► STOPPED                  (stop event set, close(), iterator closed)

Every change is checked against the table under a lock and emitted as a :class:`SourceEvent`.
Camera trouble never raises out of :meth:`VideoSource.frames`: it becomes RECONNECTING with the
reason in the event and in the ``camera.source.failed`` log line, and the source is reopened after
an exponential backoff with jitter (a camera that refused the credentials waits the longest delay
at once: cameras lock accounts out after repeated failed logins). Frame indices count from 0 for
the whole life of the source, across loops and reconnects, one per frame delivered; what a
reconnect missed is a :class:`StreamGap`, logged as ``camera.source.gap``, told in the reason of
the STREAMING event that ends it, and counted in :meth:`VideoSource.stats`.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

import structlog

from agent.camera.drivers import Driver, driver_for, missing_frames, read_timeout_s
from agent.camera.drivers.url import redact
from agent.camera.frame import Frame
from agent.camera.frame_pool import Allocator
from agent.camera.source_spec import SourceSpec
from agent.errors import CredentialsRejectedError, SourceError
from agent.transitions import TransitionTable
from agent.watchdog.liveness import CallWatch, OpenCall

log = structlog.get_logger(__name__)

T = TypeVar("T")

#: How long close() waits for a read in progress on another thread to finish before giving up
#: (the reading thread then releases the driver itself when its read returns).
CLOSE_WAIT_S = 15.0
#: Granularity at which a wait notices close() (the stop event itself is noticed at once).
_CLOSE_POLL_S = 0.1
#: Longest failure reason a source keeps for its reports (an FFmpeg message can run long).
MAX_ERROR_CHARS = 300


class SourceState(str, Enum):
    """Lifecycle state of a :class:`VideoSource`."""

    IDLE = "idle"
    CONNECTING = "connecting"
    STREAMING = "streaming"
    RECONNECTING = "reconnecting"
    ENDED = "ended"
    STOPPED = "stopped"


_S = SourceState

#: The transition table: state -> states it may change to. ENDED and STOPPED are terminal.
ALLOWED = TransitionTable(
    SourceState,
    {
        _S.IDLE: frozenset({_S.CONNECTING, _S.STOPPED}),
        _S.CONNECTING: frozenset({_S.STREAMING, _S.RECONNECTING, _S.ENDED, _S.STOPPED}),
        _S.STREAMING: frozenset({_S.RECONNECTING, _S.ENDED, _S.STOPPED}),
        _S.RECONNECTING: frozenset({_S.CONNECTING, _S.STOPPED}),
        _S.ENDED: frozenset(),
        _S.STOPPED: frozenset(),
    },
    kind="camera source",
)

#: Numeric state for telemetry (flat numeric JSON): the position in the enum.
STATE_CODES: dict[SourceState, int] = {state: code for code, state in enumerate(SourceState)}

_TERMINAL = ALLOWED.terminal
#: A backoff step far enough that :func:`backoff_delay` is at ``reconnect_max_s``.
_LONGEST_STEP = 64


def check_transition(old: SourceState, new: SourceState) -> None:
    """Raise ``RuntimeError`` unless the table allows ``old`` -> ``new`` (a bug, never camera trouble)."""
    ALLOWED.check(old, new)


def backoff_delay(attempt: int, min_s: float, max_s: float, rng: random.Random | None = None) -> float:
    """Delay before reopen attempt ``attempt`` (1-based).

    Doubles from ``min_s`` per attempt up to ``max_s``, then takes a random point in the upper
    half of that, so a fleet of cameras behind one switch that went down do not reconnect in step.
    The result always lies in ``[min_s, max(min_s, max_s)]``.
    """
    ceiling = max(min_s, max_s)
    base = min(ceiling, min_s * 2.0 ** min(max(attempt - 1, 0), 60))
    jittered = base * (0.5 + 0.5 * (rng or random).random())
    return min(ceiling, max(min_s, jittered))


@dataclass(frozen=True)
class SourceEvent:
    """One state change of a source, as emitted to ``on_event`` and logged."""

    stream: str
    old: SourceState
    new: SourceState
    reason: str
    ts: float


@dataclass(frozen=True)
class StreamGap:
    """Time without frames across a reconnect: frames ``last_index`` and ``last_index + 1`` are
    ``seconds`` apart, in which the camera sent about ``frames_missed`` frames (None: its rate unknown)."""

    last_index: int
    seconds: float
    frames_missed: int | None

    def describe(self) -> str:
        missed = "" if self.frames_missed is None else f", ~{self.frames_missed} frames missed"
        return f"{self.seconds:.2f} s without frames after frame {self.last_index}{missed}"


@dataclass(frozen=True)
class SourceReport:
    """What an operator is shown of one source (``up/info``'s ``cameras``): its state since when, its
    counters, and its last failure, credentials stripped and cut to :data:`MAX_ERROR_CHARS`."""

    state: SourceState
    since: float
    frames: int
    reconnects: int
    last_error: str | None
    last_error_at: float | None


def failure_reason(exc: BaseException) -> str:
    """What an operator is told of a failure: the message without ``user:password@``, cut short."""
    text = redact(str(exc) or type(exc).__name__)
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


class _ClosedError(Exception):
    """close() was called: the iterating thread must stop touching the driver."""


class VideoSource:
    """Frames of one camera stream, reopened with backoff whenever the camera fails.

    ``on_event`` is called for every state change, on the thread that made it and while the
    source's lock is held: it must only enqueue (and must not call back into ``frames``).
    """

    def __init__(
        self,
        stream: str,
        spec: SourceSpec,
        *,
        on_event: Callable[[SourceEvent], None] | None = None,
    ) -> None:
        self.stream = stream
        self.spec = spec
        self._on_event = on_event
        self._driver: Driver[Any] = driver_for(spec)
        # RLock: an on_event callback may read ``state`` or ``stats()`` on the same thread.
        self._lock = threading.RLock()
        # Held for every call into the driver, so close() on another thread never releases a
        # capture in the middle of a read (OpenCV does not survive that).
        self._driver_lock = threading.Lock()
        # The driver call in progress, for the watchdog: a read stuck in a camera driver is the
        # one hang that no state change and no frame counter can show.
        self._call = CallWatch()
        self._state = SourceState.IDLE
        self._closed = False
        self._index = 0
        self._frames = 0
        self._reconnects = 0
        self._read_failures = 0
        self._open_failures = 0
        self._gaps = 0
        self._gap_s = 0.0
        self._gap_frames_missed = 0
        self._last_gap: StreamGap | None = None
        self._rng = random.Random()
        self._since = time.time()
        self._created_mono = time.monotonic()
        self._last_frame_mono: float | None = None
        self._last_error: str | None = None
        self._last_error_at: float | None = None

    # -- public API ---------------------------------------------------------------------------

    @property
    def state(self) -> SourceState:
        """The current state."""
        with self._lock:
            return self._state

    @property
    def is_live(self) -> bool:
        """False only for file sources: the pipeline then processes every frame instead of dropping."""
        return self._driver.is_live

    @property
    def nominal_fps(self) -> float | None:
        """The source's own frame rate, known once it has been opened (None if it does not say)."""
        return self._driver.nominal_fps

    def frames(self, stop: threading.Event) -> Generator[Frame, None, None]:
        """Yield frames until the stream ends, ``stop`` is set or :meth:`close` is called.

        May be iterated once. Never raises on camera trouble; see the module docstring. Closing the
        generator (``.close()``, or dropping it) stops the source and releases the camera.
        """
        with self._lock:
            if self._closed:
                return
            if self._state is not SourceState.IDLE:
                raise RuntimeError(f"source {self.stream!r} is already {self._state.value}; make a new one")
            if stop.is_set():
                self._transition(SourceState.STOPPED, "stop requested before start")
                return
            self._transition(SourceState.CONNECTING, f"opening {self.spec.type} source")
        reason: str | None = None
        try:
            yield from self._run(stop)
        except GeneratorExit:
            reason = "frame iterator closed by its consumer"
            raise
        finally:
            # close() from another thread sets _closed before it takes the driver: the reading thread
            # may see it first and end the loop, and the stop then still says it came from close().
            self._release(reason or ("closed" if self._closed else "stop requested"))

    def decode_into(self, allocate: Allocator | None) -> None:
        """Decode frames into buffers ``allocate`` makes (page-locked memory for the GPU path; None:
        the decoder's own arrays). Call it from the thread that iterates :meth:`frames`."""
        self._driver.buffers.allocate_with(allocate)

    def driver_call(self) -> OpenCall | None:
        """The driver call (``open``, ``read``, ``close``) in progress now, and for how long.

        None between calls: while waiting out a reconnect backoff or pacing a file, the source is
        not inside the driver, so a camera that is unplugged and reconnecting never looks stuck.
        """
        return self._call.current()

    def stats(self) -> dict[str, float]:
        """Counters for telemetry.

        ``frames``: frames yielded; ``reconnects``: times the source entered RECONNECTING;
        ``read_failures`` / ``open_failures``: failed reads / opens; ``state``: :data:`STATE_CODES`;
        ``gaps`` / ``gap_s``: reconnects after which frames came again, and the seconds without
        frames they cost; ``frames_missed``: frames the camera sent that never arrived (estimated
        over those gaps from the camera's rate, plus jumps in the stream's own timestamps where the
        driver can see them).
        ``last_frame_age_s``: seconds since the last frame (since the source was made, before the first).
        """
        with self._lock:
            last = self._created_mono if self._last_frame_mono is None else self._last_frame_mono
            return {
                "frames": float(self._frames),
                "reconnects": float(self._reconnects),
                "read_failures": float(self._read_failures),
                "open_failures": float(self._open_failures),
                "state": float(STATE_CODES[self._state]),
                "gaps": float(self._gaps),
                "gap_s": round(self._gap_s, 3),
                "frames_missed": float(self._gap_frames_missed + self._driver.frames_missing),
                "last_frame_age_s": round(max(0.0, time.monotonic() - last), 3),
            }

    @property
    def last_gap(self) -> StreamGap | None:
        """The latest time without frames across a reconnect, None if frames never stopped."""
        with self._lock:
            return self._last_gap

    def report(self) -> SourceReport:
        """The source as an operator is shown it (:class:`SourceReport`)."""
        with self._lock:
            return SourceReport(
                state=self._state,
                since=self._since,
                frames=self._frames,
                reconnects=self._reconnects,
                last_error=self._last_error,
                last_error_at=self._last_error_at,
            )

    def close(self) -> None:
        """Stop the source and release the driver. Idempotent; safe from any thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._driver_lock.acquire(timeout=CLOSE_WAIT_S):
            try:
                self._driver.close()
            finally:
                self._driver_lock.release()
        else:
            # The reading thread releases the driver as soon as its blocked read returns.
            log.warning("camera.source.close_timeout", stream=self.stream, waited_s=CLOSE_WAIT_S)
        with self._lock:
            if self._state not in _TERMINAL:
                self._transition(SourceState.STOPPED, "closed")

    # -- the loop -----------------------------------------------------------------------------

    def _run(self, stop: threading.Event) -> Iterator[Frame]:
        attempt = 0  # consecutive failures; 0 once a frame has arrived
        while True:
            try:
                self._drive(self._driver.open)
            except _ClosedError:
                return
            except Exception as exc:  # noqa: BLE001 - supervised loop: any open failure is retried
                self._open_failures += 1
                attempt += 1
                if not self._back_off(stop, attempt, "open", exc):
                    return
                continue
            first = True
            next_due = time.monotonic()
            while True:
                if stop.is_set() or self._closed:
                    return
                pace = self._driver.pace_fps
                if pace:
                    if self._wait(stop, next_due - time.monotonic()):
                        return
                    next_due = max(next_due + 1.0 / pace, time.monotonic())
                try:
                    image = self._drive(self._driver.read, read_timeout_s(self._driver.nominal_fps))
                except _ClosedError:
                    return
                except Exception as exc:  # noqa: BLE001 - supervised loop: any read failure reconnects
                    self._read_failures += 1
                    attempt += 1
                    if not self._back_off(stop, attempt, "read", exc):
                        return
                    break
                if image is None:
                    self._advance(SourceState.ENDED, "end of stream")
                    return
                captured_at, captured_mono = time.time(), time.monotonic()
                if first:
                    first = False
                    attempt = 0
                    gap = self._record_gap(captured_mono)
                    reason = "first frame after open" + (f": {gap.describe()}" if gap else "")
                    if not self._advance(SourceState.STREAMING, reason):
                        return
                frame = Frame(
                    stream=self.stream,
                    index=self._index,
                    image=image,
                    captured_at=captured_at,
                    captured_mono=captured_mono,
                    native_size=self._driver.native_size,
                )
                with self._lock:
                    self._index += 1
                    self._frames += 1
                    self._last_frame_mono = captured_mono
                yield frame

    def _record_gap(self, resumed_mono: float) -> StreamGap | None:
        """The gap a reopen ends (None on the first open), counted and logged."""
        with self._lock:
            if self._last_frame_mono is None:
                return None
            seconds = resumed_mono - self._last_frame_mono
            fps = self._driver.nominal_fps
            missed = missing_frames(seconds, fps) if fps else None
            gap = StreamGap(last_index=self._index - 1, seconds=seconds, frames_missed=missed)
            self._gaps += 1
            self._gap_s += seconds
            self._gap_frames_missed += missed or 0
            self._last_gap = gap
        log.warning(
            "camera.source.gap",
            stream=self.stream,
            last_index=gap.last_index,
            resumed_index=gap.last_index + 1,
            gap_s=round(seconds, 3),
            frames_missed=missed,
        )
        return gap

    def _back_off(self, stop: threading.Event, attempt: int, phase: str, exc: Exception) -> bool:
        """Enter RECONNECTING, release the driver, wait, enter CONNECTING. False: stop instead."""
        reason = failure_reason(exc)
        # Refused credentials do not get better by retrying soon: wait as long as the backoff goes.
        step = _LONGEST_STEP if isinstance(exc, CredentialsRejectedError) else attempt
        delay = backoff_delay(step, self.spec.reconnect_min_s, self.spec.reconnect_max_s, self._rng)
        with self._lock:
            self._last_error, self._last_error_at = reason, time.time()
        log.warning(
            "camera.source.failed",
            stream=self.stream,
            source_type=self.spec.type,
            phase=phase,
            reason=reason,
            attempt=attempt,
            retry_in_s=round(delay, 3),
            # A SourceError is an expected camera problem; anything else is a driver bug worth a trace.
            exc_info=not isinstance(exc, SourceError),
        )
        if not self._advance(SourceState.RECONNECTING, reason):
            return False
        with self._lock:
            self._reconnects += 1
        try:
            self._drive(self._driver.close)
        except _ClosedError:
            return False
        if self._wait(stop, delay):
            return False
        return self._advance(SourceState.CONNECTING, f"reconnect attempt {attempt}")

    def _wait(self, stop: threading.Event, delay: float) -> bool:
        """Sleep ``delay`` seconds; True as soon as ``stop`` is set or close() was called."""
        deadline = time.monotonic() + delay
        while not self._closed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return stop.is_set()
            if stop.wait(min(remaining, _CLOSE_POLL_S)):
                return True
        return True

    def _drive(self, call: Callable[..., T], *args: Any) -> T:
        """Call into the driver, unless close() has been called (then raise ``_ClosedError``)."""
        with self._driver_lock:
            if self._closed:
                raise _ClosedError
            self._call.enter(call.__name__)
            try:
                return call(*args)
            finally:
                self._call.leave()

    def _release(self, reason: str) -> None:
        with self._driver_lock:
            self._call.enter("close")
            try:
                self._driver.close()
            finally:
                self._call.leave()
            # The stream is over: its buffers go back once the frames still in the pipeline are done.
            self._driver.buffers.clear()
        with self._lock:
            if self._state not in _TERMINAL:
                self._transition(SourceState.STOPPED, reason)

    # -- state --------------------------------------------------------------------------------

    def _advance(self, new: SourceState, reason: str) -> bool:
        """Transition from the iterating thread; False when close() got there first."""
        with self._lock:
            if self._closed or self._state in _TERMINAL:
                return False
            self._transition(new, reason)
            return True

    def _transition(self, new: SourceState, reason: str) -> None:
        """Change state (lock held), checked against :data:`ALLOWED`, and emit the event."""
        old = self._state
        check_transition(old, new)
        self._state = new
        self._since = time.time()
        event = SourceEvent(stream=self.stream, old=old, new=new, reason=reason, ts=self._since)
        log.info("camera.source.state", stream=self.stream, old=old.value, new=new.value, reason=reason)
        if self._on_event is not None:
            try:
                self._on_event(event)
            except Exception:
                log.exception("camera.source.event_callback_failed", stream=self.stream)
