"""What TensorRT says during a build: a bounded :class:`BuildLog` and the ``trt.ILogger`` that fills it."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from agent.engines.trt.placement import NO_LAYER, PLACEMENT_HEADER, PLACEMENT_TAGGED

if TYPE_CHECKING:
    import tensorrt as trt


_SEVERITY_TAG = {"INTERNAL_ERROR": "F", "ERROR": "E", "WARNING": "W", "INFO": "I", "VERBOSE": "V"}


class BuildLog:
    """What TensorRT said during a build, bounded in memory.

    Keeps the last ``max_lines`` INFO-or-worse messages (verbose builds emit hundreds of
    thousands), and every line of the placement block whatever its severity (TensorRT 10 logs it
    at VERBOSE, 8.x at INFO). Errors are forwarded to ``sink`` as they happen.
    """

    def __init__(self, max_lines: int = 2000, sink: Callable[[str], None] | None = None) -> None:
        self._lines: deque[str] = deque(maxlen=max_lines)
        self._placement: list[str] = []
        self._after_header = False
        self._sink = sink
        self.errors: list[str] = []

    def add(self, severity: str, message: str) -> None:
        tag = _SEVERITY_TAG.get(severity.upper(), "?")
        line = f"[{tag}] {message}"
        if tag != "V":
            self._lines.append(line)
        if tag in ("F", "E"):
            self.errors.append(message)
            if self._sink is not None:
                self._sink(line)
        self._track_placement(message)

    def _track_placement(self, message: str) -> None:
        if PLACEMENT_HEADER.search(message):
            self._placement.append(message)
            self._after_header = True
        elif PLACEMENT_TAGGED.search(message) or NO_LAYER.search(message):
            self._placement.append(message)
            self._after_header = False
        elif self._after_header:
            # The 7.x form puts the section on the line after its header.
            self._placement.append(message)
            self._after_header = False

    def text(self) -> str:
        return "\n".join(self._lines)

    def tail(self, lines: int = 30) -> str:
        return "\n".join(list(self._lines)[-lines:])

    def placement_text(self) -> str:
        return "\n".join(self._placement)


def capturing_logger(build_log: BuildLog) -> trt.ILogger:
    """A ``trt.ILogger`` that records every message into ``build_log`` (needs TensorRT)."""
    import tensorrt as trt

    class CapturingLogger(trt.ILogger):
        def __init__(self) -> None:
            # pybind11 trampoline: the base __init__ must run or TensorRT cannot call log().
            trt.ILogger.__init__(self)

        def log(self, severity: trt.ILogger.Severity, msg: str) -> None:
            try:
                build_log.add(getattr(severity, "name", str(severity)), msg)
            except Exception:  # noqa: BLE001 - an exception must never propagate into TensorRT's C++
                return

    logger: trt.ILogger = CapturingLogger()
    return logger
