"""Runs a VideoSource's frame iterator on a thread and records frames and state events."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from agent.camera.frame import Frame
from agent.camera.source import SourceEvent, SourceState, VideoSource
from agent.camera.source_spec import SourceSpec
from tests.waiting import patient

WAIT_S = 20.0


class Recorder:
    """A source consumed on a thread, the way the pipeline's capture stage consumes it."""

    def __init__(self, stream: str, spec: SourceSpec) -> None:
        self.lock = threading.Lock()
        self.frames: list[Frame] = []
        self.events: list[SourceEvent] = []
        self.error: BaseException | None = None
        self.stop_event = threading.Event()
        self.source = VideoSource(stream, spec, on_event=self._on_event)
        self.thread = threading.Thread(target=self._consume, name=f"recorder-{stream}", daemon=True)

    def _on_event(self, event: SourceEvent) -> None:
        with self.lock:
            self.events.append(event)

    def _consume(self) -> None:
        try:
            for frame in self.source.frames(self.stop_event):
                with self.lock:
                    self.frames.append(frame)
        except BaseException as exc:  # surfaced by the test through .error
            self.error = exc

    def start(self) -> Recorder:
        self.thread.start()
        return self

    def transitions(self) -> list[tuple[SourceState, SourceState]]:
        with self.lock:
            return [(e.old, e.new) for e in self.events]

    def count(self, new: SourceState) -> int:
        with self.lock:
            return sum(1 for e in self.events if e.new is new)

    def frame_count(self) -> int:
        with self.lock:
            return len(self.frames)

    def wait_until(self, what: str, predicate: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
        """Poll ``predicate`` until it holds; fail with the recorded history when it does not."""
        deadline = time.monotonic() + patient(timeout_s)
        while not predicate():
            if self.error is not None:
                raise AssertionError(f"frame iterator raised while waiting for {what}") from self.error
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out waiting for {what}; frames={self.frame_count()} events="
                    f"{[(e.old.value, e.new.value, e.reason) for e in self.events]}"
                )
            time.sleep(0.02)

    def finish(self, timeout_s: float = WAIT_S) -> None:
        """Wait for the iterator to return by itself (ENDED), without setting stop."""
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "frame iterator did not return"
        assert self.error is None, f"frame iterator raised {self.error!r}"

    def stop(self, timeout_s: float = WAIT_S) -> None:
        """Set the stop event and wait (bounded) for the iterator to return."""
        self.stop_event.set()
        self.finish(timeout_s)
        self.source.close()
