"""A real RTSP camera on 127.0.0.1 for tests and benches: gst-rtsp-server in a subprocess.

The server (tests/camera/rtsp_serve.py) runs under the system python3, which has PyGObject and
gst-rtsp-server from Debian packages (tools/os-deps.sh); ``.venv`` has neither. Each frame carries
its number since the camera started and the wall-clock millisecond it was made (:func:`read_marks`).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

import numpy as np
import numpy.typing as npt

from agent.demo.broker import free_port
from tests.waiting import patient

SYSTEM_PYTHON = "/usr/bin/python3"
SERVE = Path(__file__).with_name("rtsp_serve.py")
BITS, ROWS = 32, 3


def rtsp_server_missing() -> str | None:
    """Why no RTSP camera can be started here, or None when it can."""
    probe = "import gi; gi.require_version('GstRtspServer', '1.0'); from gi.repository import GstRtspServer"
    try:
        subprocess.run([SYSTEM_PYTHON, "-c", probe], check=True, capture_output=True, timeout=patient(30))
    except (OSError, subprocess.SubprocessError):
        return "gst-rtsp-server for the system python3 missing: run `make os-deps`"
    return None


@dataclass(frozen=True)
class Marks:
    """What a decoded frame says about itself."""

    counter: int  # frame number since the camera started
    made_ms: int  # wall clock (ms, modulo 2**32) when the server made it
    intact: bool  # the counter row and its inverse agree


def read_marks(image: npt.NDArray[np.uint8]) -> Marks:
    """Read the blocks rtsp_serve.frame_bytes burns into the top of every frame."""
    height, width = image.shape[:2]
    block_w, block_h = width // BITS, max(8, height // 15)
    values = []
    for row in range(ROWS):
        y0, y1 = row * block_h + block_h // 4, row * block_h + 3 * block_h // 4
        value = 0
        for bit in range(BITS):
            x0, x1 = bit * block_w + block_w // 4, bit * block_w + 3 * block_w // 4
            value = value << 1 | int(image[y0:y1, x0:x1].mean() > 128)
        values.append(value)
    counter, made_ms, inverse = values
    return Marks(counter=counter, made_ms=made_ms, intact=counter ^ inverse == 2**BITS - 1)


class RtspCamera:
    """One camera at ``rtsp://127.0.0.1:port/stream``; :meth:`restart` is a reboot on the same port.

    ``user`` set: the camera asks for Basic credentials; its password is made here, at run time.
    ``protocols``: which RTP transports the camera offers. ``loss``: probability of dropping each RTP
    packet. ``silent``: answers RTSP, then never sends a frame.
    """

    def __init__(
        self,
        *,
        codec: Literal["h264", "h265"] = "h264",
        width: int = 320,
        height: int = 240,
        fps: int = 25,
        gop: int = 10,
        protocols: Literal["tcp", "udp", "both"] = "both",
        loss: float = 0.0,
        user: str = "",
        silent: bool = False,
    ) -> None:
        self.codec, self.width, self.height, self.fps, self.gop = codec, width, height, fps, gop
        self.protocols, self.loss, self.silent = protocols, loss, silent
        self.user = user
        self.password = secrets.token_urlsafe(12) if user else ""
        self.port = free_port()
        self.clients = 0  # RTSP connections accepted, over every start
        self._process: subprocess.Popen[str] | None = None
        self._ready = threading.Event()
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        """The stream's URL, with the right credentials when the camera asks for them."""
        return self.url_as(self.user, self.password) if self.user else f"rtsp://127.0.0.1:{self.port}/stream"

    def url_as(self, user: str, password: str) -> str:
        return f"rtsp://{user}:{password}@127.0.0.1:{self.port}/stream"

    def start(self) -> RtspCamera:
        argv = [
            SYSTEM_PYTHON,
            str(SERVE),
            f"--port={self.port}",
            f"--codec={self.codec}",
            f"--width={self.width}",
            f"--height={self.height}",
            f"--fps={self.fps}",
            f"--gop={self.gop}",
            f"--protocols={self.protocols}",
            f"--loss={self.loss}",
        ]
        if self.user:
            argv.append(f"--user={self.user}")
        if self.silent:
            argv.append("--silent")
        env = {**os.environ, "RTSP_PASSWORD": self.password}
        self._ready.clear()
        self._process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
        )
        assert self._process.stdout is not None
        threading.Thread(target=self._watch, args=(self._process.stdout,), daemon=True).start()
        if not self._ready.wait(patient(20)):
            self.stop()
            raise AssertionError(f"RTSP camera on port {self.port} did not start")
        return self

    def _watch(self, stdout: IO[str]) -> None:
        for line in stdout:
            if line.startswith("ready"):
                self._ready.set()
            elif line.startswith("client"):
                with self._lock:
                    self.clients += 1

    def connections(self) -> int:
        with self._lock:
            return self.clients

    def stop(self) -> None:
        """Kill the camera: every session ends at once, as when it loses power."""
        if self._process is None:
            return
        self._process.kill()
        self._process.wait(patient(10))
        self._process = None

    def restart(
        self,
        *,
        codec: Literal["h264", "h265"] | None = None,
        width: int | None = None,
        height: int | None = None,
    ) -> None:
        """Stop and start again on the same port, optionally with another codec or frame size."""
        self.stop()
        self.codec = codec or self.codec
        self.width = width or self.width
        self.height = height or self.height
        self.start()
