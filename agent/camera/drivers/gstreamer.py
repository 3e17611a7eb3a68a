"""GStreamer pipelines run as a ``gst-launch-1.0`` subprocess that writes raw BGR frames to stdout.

The pipeline is the configured one, or built for a configured camera by
:mod:`agent.camera.gst_pipelines` (hardware decode and VIC scaling where the elements exist, probed
with ``gst-inspect-1.0 --exists`` on the first open).

The pip OpenCV wheel has no GStreamer support, and a Jetson CSI camera is only reachable through
``nvarguscamerasrc``; running the pipeline in a child process also keeps a crashing camera stack
out of the agent. Frames are fixed-size (``width * height * 3`` bytes), so the reader cuts the byte
stream without any framing protocol.
"""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import shlex
import shutil
import signal
import subprocess
import time
from typing import ClassVar

import numpy as np
import structlog

from agent.camera.drivers.base import Driver, Image
from agent.camera.gst_pipelines import BuiltPipeline, build_pipeline, elements_needed
from agent.camera.source_spec import GStreamerSourceSpec
from agent.errors import SourceError

log = structlog.get_logger(__name__)

#: The first frame may take long: nvarguscamerasrc spends seconds starting the ISP and auto exposure.
FIRST_FRAME_TIMEOUT_S = 10.0
#: How much of the child's stderr is kept for the error message.
STDERR_TAIL_BYTES = 4096
#: Grace periods of each step of close(): SIGINT, then SIGTERM, then SIGKILL.
_STOP_GRACE_S = 1.0

#: gst-inspect-1.0 loads its plugin registry on the first run (seconds on a Jetson's first boot).
_PROBE_TIMEOUT_S = 30.0

_FRAMERATE = re.compile(r"framerate=(?:\(fraction\))?\s*(\d+)\s*/\s*(\d+)")


def pipeline_fps(pipeline: str) -> float | None:
    """The rate named by the last ``framerate=N/D`` caps field of a pipeline, if any."""
    matches = _FRAMERATE.findall(pipeline)
    if not matches:
        return None
    num, den = (int(x) for x in matches[-1])
    return num / den if num > 0 and den > 0 else None


class GStreamerDriver(Driver[GStreamerSourceSpec]):
    """Runs ``gst-launch-1.0 -q <pipeline> ! fdsink fd=1`` and reads one frame per ``read``."""

    kind: ClassVar[str] = "gstreamer"

    def __init__(self, spec: GStreamerSourceSpec) -> None:
        super().__init__(spec)
        self._proc: subprocess.Popen[bytes] | None = None
        self._selector: selectors.BaseSelector | None = None
        self._stderr_tail = bytearray()
        self._frames_since_open = 0
        #: The pipeline built for ``spec.camera`` (on the first open: it probes the elements once).
        self.built: BuiltPipeline | None = None
        self.width = spec.width or 0
        self.height = spec.height or 0
        self.frame_bytes = self.width * self.height * 3

    def pipeline(self) -> str:
        """The pipeline run, up to the sink: as written, or built for the camera on first use."""
        if self.spec.pipeline is not None:
            return self.spec.pipeline
        if self.built is None:
            assert self.spec.camera is not None  # the spec's validator: pipeline or camera
            built = build_pipeline(self.spec, probe_elements(elements_needed(self.spec.camera)))
            log.info(
                "camera.gstreamer.pipeline",
                pipeline=built.pipeline,
                hardware=built.hardware,
                reason=built.reason,
            )
            self.built = built
            self.width, self.height = built.width, built.height
            self.frame_bytes = built.width * built.height * 3
            if (built.width, built.height) != built.native:
                self.native_size = built.native
        return self.built.pipeline

    @property
    def pid(self) -> int | None:
        """Process id of the running ``gst-launch-1.0``, or None when closed."""
        return self._proc.pid if self._proc is not None else None

    def command(self) -> list[str]:
        """The argument list of the child process."""
        try:
            elements = shlex.split(self.pipeline())
        except ValueError as exc:
            raise SourceError(
                f"gstreamer pipeline cannot be split into arguments ({exc}): check quoting"
            ) from exc
        if not elements:
            raise SourceError("gstreamer pipeline is empty: set source.pipeline")
        # -q matters: without it gst-launch prints progress messages to stdout, among the frames.
        return ["gst-launch-1.0", "-q", *elements, "!", "fdsink", "fd=1"]

    def open(self) -> None:
        command = self.command()
        executable = shutil.which(command[0])
        if executable is None:
            raise SourceError(
                "gst-launch-1.0 is not installed: install gstreamer1.0-tools (and the plugins the "
                "pipeline uses, e.g. gstreamer1.0-plugins-base/good)"
            )
        self.close()
        try:
            proc = subprocess.Popen(
                [executable, *command[1:]],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                bufsize=0,
                # Own process group: close() signals the whole group, and a Ctrl-C on the agent's
                # terminal does not reach the camera before the agent has stopped reading it.
                start_new_session=True,
            )
        except OSError as exc:
            raise SourceError(f"cannot start gst-launch-1.0: {exc}") from exc
        assert proc.stdout is not None
        assert proc.stderr is not None
        selector = selectors.DefaultSelector()
        selector.register(proc.stdout, selectors.EVENT_READ, "stdout")
        selector.register(proc.stderr, selectors.EVENT_READ, "stderr")
        self._proc = proc
        self._selector = selector
        self._stderr_tail.clear()
        self._frames_since_open = 0
        self.nominal_fps = pipeline_fps(self.pipeline())

    def read(self, timeout_s: float) -> Image | None:
        if self._proc is None or self._selector is None or self._proc.stdout is None:
            raise SourceError("gstreamer source read before open")
        if self._frames_since_open == 0:
            timeout_s = max(timeout_s, FIRST_FRAME_TIMEOUT_S)
        deadline = time.monotonic() + timeout_s
        shape = (self.height, self.width, 3)
        taken = self.buffers.take()
        image = taken if taken is not None and taken.shape == shape else np.empty(shape, np.uint8)
        view = image.data.cast("B")
        got = 0
        stdout_fd = self._proc.stdout.fileno()
        while got < self.frame_bytes:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SourceError(
                    f"gstreamer pipeline delivered no frame within {timeout_s:.1f} s"
                    f"{self._stderr_suffix()}: check that the camera is connected and the pipeline runs "
                    "with gst-launch-1.0"
                )
            for key, _ in self._selector.select(remaining):
                if key.data == "stderr":
                    self._drain_stderr(key.fd)
                    continue
                n = os.readv(stdout_fd, [view[got:]])
                if n == 0:
                    raise SourceError(self._exit_reason(partial=got))
                got += n
        self._frames_since_open += 1
        view.release()
        self.buffers.keep(image, taken)
        return image

    def _drain_stderr(self, fd: int) -> None:
        chunk = os.read(fd, STDERR_TAIL_BYTES)
        if not chunk:
            # EOF: stop watching it, or select() would report it readable forever.
            if self._selector is not None:
                self._selector.unregister(fd)
            return
        self._stderr_tail += chunk
        del self._stderr_tail[:-STDERR_TAIL_BYTES]

    def _stderr_suffix(self) -> str:
        text = self._stderr_tail.decode("utf-8", "replace").strip()
        return f"; gst-launch said: {text}" if text else ""

    def _exit_reason(self, partial: int) -> str:
        assert self._proc is not None
        assert self._selector is not None
        try:
            code: int | None = self._proc.wait(timeout=_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            code = None
        # Collect what the child wrote last: that is usually the reason it stopped.
        deadline = time.monotonic() + 0.5
        while self._selector.get_map() and time.monotonic() < deadline:
            events = self._selector.select(deadline - time.monotonic())
            stderr_events = [key for key, _ in events if key.data == "stderr"]
            if not stderr_events:
                break
            for key in stderr_events:
                self._drain_stderr(key.fd)
        what = f"exited with code {code}" if code is not None else "closed its output"
        if partial:
            what += (
                f" in the middle of a frame ({partial} of {self.frame_bytes} bytes: do the caps give "
                f"format=BGR,width={self.width},height={self.height}?)"
            )
        return f"gstreamer pipeline {what} after {self._frames_since_open} frames{self._stderr_suffix()}"

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if self._selector is not None:
            self._selector.close()
            self._selector = None
        if proc is None:
            return
        # SIGINT first: gst-launch then stops the pipeline cleanly, which nvargus-daemon needs to
        # hand the sensor to the next client. SIGTERM and SIGKILL follow for a pipeline that hangs.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
            if proc.poll() is not None:
                break
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            if sig == signal.SIGINT:
                # A child blocked writing a frame into the full pipe cannot shut down until the
                # write returns, so keep reading (and discarding) while it stops.
                _discard_output_until_exit(proc, _STOP_GRACE_S)
            else:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=_STOP_GRACE_S)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        # Reap in every case: a child that exited on its own is a zombie until waited for.
        try:
            proc.wait(timeout=_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            log.error("camera.gstreamer.unreaped", pid=proc.pid)


def probe_elements(names: tuple[str, ...]) -> frozenset[str]:
    """Which of ``names`` this machine's GStreamer has (``gst-inspect-1.0 --exists``), none without it."""
    inspect = shutil.which("gst-inspect-1.0")
    if inspect is None:
        return frozenset()
    found = set()
    for name in names:
        try:
            done = subprocess.run(
                [inspect, "--exists", name], capture_output=True, timeout=_PROBE_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0:
            found.add(name)
    return frozenset(found)


def _discard_output_until_exit(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """Read and drop the child's output until it exits or ``grace_s`` passes."""
    streams = [s for s in (proc.stdout, proc.stderr) if s is not None]
    deadline = time.monotonic() + grace_s
    with selectors.DefaultSelector() as selector:
        for stream in streams:
            selector.register(stream, selectors.EVENT_READ)
        while proc.poll() is None and selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            for key, _ in selector.select(min(remaining, 0.05)):
                if not os.read(key.fd, 1 << 16):
                    selector.unregister(key.fileobj)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
