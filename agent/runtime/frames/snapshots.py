"""The latest frame of each stream together with the result published for that very frame.

The frame path hands over references, never copies: when a batch has been inferred, the newest
frame of each stream in it is *pending* here (its image array is one the capture already owns and
no stage writes to again); when the publisher sends the result for that frame index, the pair
becomes the stream's *latest*. So at most two images per stream are held, a result is never paired
with another frame's image, and nothing is encoded until a ``snapshot`` command asks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from agent.protocol.messages import ResultMessage


@dataclass(frozen=True)
class Snapshot:
    """One frame (BGR, as decoded) and the result message published for it."""

    image: npt.NDArray[np.uint8]
    result: ResultMessage


class SnapshotBoard:
    """Per stream: the frame waiting for its result, and the latest frame that has one (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[int, npt.NDArray[np.uint8]]] = {}
        self._latest: dict[str, Snapshot] = {}
        #: Called with each frame paired with its result (outside the lock): the slot's sampler.
        self.on_paired: Callable[[npt.NDArray[np.uint8], ResultMessage], object] | None = None

    def inferred(self, stream: str, index: int, image: npt.NDArray[np.uint8]) -> None:
        """Frame ``index`` of ``stream`` was inferred; its result comes next (a newer frame wins)."""
        with self._lock:
            held = self._pending.get(stream)
            # With several inference workers batches finish out of order: keep the newest frame.
            if held is None or index > held[0]:
                self._pending[stream] = (index, image)

    def published(self, result: ResultMessage) -> None:
        """The result for ``result.frame_index`` went out: pair it with its frame if that is pending."""
        with self._lock:
            held = self._pending.get(result.stream)
            if held is None or held[0] != result.frame_index:
                return
            del self._pending[result.stream]
            self._latest[result.stream] = Snapshot(held[1], result)
        if self.on_paired is not None:
            self.on_paired(held[1], result)

    def latest(self, stream: str) -> Snapshot | None:
        """The stream's latest frame with its result; None before the first result."""
        with self._lock:
            return self._latest.get(stream)
