"""A real HTTP MJPEG camera on 127.0.0.1: multipart/x-mixed-replace, JPEG frames encoded by cv2."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import cv2
import numpy as np

from tests.waiting import patient

BOUNDARY = "frame"


class MjpegServer:
    """Serves an endless MJPEG stream of solid frames; can be stopped and restarted on its port.

    :meth:`stall` makes it a camera that hangs mid-frame: it sends the first half of one more
    frame and then nothing, keeping the connection open, so the reader blocks inside its read.
    Frames cycle through grey levels 0..199, or all have :attr:`level` once it is set (a scene that
    turns bright, while the stream runs).
    """

    def __init__(self, width: int = 64, height: int = 48, fps: float = 50.0) -> None:
        self.width, self.height, self.interval = width, height, 1.0 / fps
        self.port = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._stalled = threading.Event()
        self._connections: list[socket.socket] = []
        self._lock = threading.Lock()
        self.sent = 0
        self.level: int | None = None

    def start(self) -> MjpegServer:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with owner._lock:
                    owner._connections.append(self.connection)
                self.send_response(200)
                self.send_header("Content-Type", f"multipart/x-mixed-replace; boundary={BOUNDARY}")
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                while not owner._stopping.is_set():
                    value = owner.sent % 200 if owner.level is None else owner.level
                    image = np.full((owner.height, owner.width, 3), value, dtype=np.uint8)
                    ok, jpeg = cv2.imencode(".jpg", image)
                    assert ok
                    body = jpeg.tobytes()
                    head = f"--{BOUNDARY}\r\nContent-Type: image/jpeg\r\nContent-Length: {len(body)}\r\n\r\n"
                    if owner._stalled.is_set():
                        with contextlib.suppress(OSError):
                            self.wfile.write(head.encode() + body[: len(body) // 2])
                        owner._stopping.wait()  # hold the connection open, silent, until stop()
                        return
                    try:
                        self.wfile.write(head.encode() + body + b"\r\n")
                    except OSError:
                        return
                    owner.sent += 1
                    time.sleep(owner.interval)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._stopping.clear()
        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stall(self) -> None:
        """From the next frame on, send half a frame and then nothing on every open stream."""
        self._stalled.set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/stream.mjpg"

    def stop(self) -> None:
        """Stop listening and cut every open stream, like a camera losing power."""
        if self._server is None:
            return
        self._stopping.set()
        self._stalled.clear()
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            for conn in self._connections:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                conn.close()
            self._connections.clear()
        if self._thread is not None:
            self._thread.join(patient(5))
        self._server = None
