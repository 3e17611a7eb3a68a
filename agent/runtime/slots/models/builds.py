"""The engine builds running for slots outside a deployment (start-up, config reload), for up/info.

A deployment's build reports in its job status; a build the slot started itself has no job, so
up/info says what is being built, since when, its phase and estimate (``SlotInfo.building``). The
device republishes up/info on progress at most once per
:data:`~agent.engines.building.progress.PUBLISH_INTERVAL_S` per slot.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from agent.engines.building.progress import PUBLISH_INTERVAL_S, ProgressTracker
from agent.engines.job import Progress


@dataclass
class _Build:
    model_id: str
    version: str | None
    since: float  # Unix seconds
    tracker: ProgressTracker


class SlotBuilds:
    """Which slot builds what; ``publish`` is called (rate-bounded) when its progress moved."""

    def __init__(self, publish: Callable[[], None], clock: Callable[[], float] = time.monotonic) -> None:
        self._publish = publish
        self._clock = clock
        self._lock = threading.Lock()
        self._builds: dict[str, _Build] = {}

    @contextmanager
    def building(self, slot: str, model_id: str, version: str | None) -> Iterator[Progress]:
        """The record of a build for ``slot`` while the block runs; yields the builder's callback.
        A heartbeat republishes elapsed seconds while the build says nothing."""
        build = _Build(model_id, version, time.time(), ProgressTracker(self._clock()))
        with self._lock:
            self._builds[slot] = build

        def say(message: str) -> None:
            if build.tracker.update(message, self._clock()) is not None:
                self._publish()

        def beat() -> None:
            if build.tracker.due(self._clock()) is not None:
                self._publish()

        try:
            with heartbeat(beat):
                yield say
        finally:
            with self._lock:
                self._builds.pop(slot, None)

    def info(self, slot: str) -> dict[str, object] | None:
        """``SlotInfo.building`` of ``slot`` (None: nothing builds for it)."""
        with self._lock:
            build = self._builds.get(slot)
        if build is None:
            return None
        state = build.tracker.shown  # what its last publication said (a short phase is kept there)
        elapsed = max(0.0, self._clock() - state.started)
        progress = state.as_dict() | {"elapsed_s": round(elapsed, 1)}
        return {"model_id": build.model_id, "version": build.version, "since": build.since, **progress}


@contextmanager
def heartbeat(beat: Callable[[], None], interval_s: float = PUBLISH_INTERVAL_S) -> Iterator[None]:
    """Call ``beat`` every ``interval_s`` seconds on a thread of its own while the block runs."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(interval_s):
            beat()

    thread = threading.Thread(target=run, name="build-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(interval_s)
