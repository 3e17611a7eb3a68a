"""Serving the console: uvicorn in a thread of the controller, on a socket bound before it starts.

The socket is bound here, in the caller's thread, so a port in use or a host that is not ours fails
the controller's start with a clear error instead of a log line in a background thread; port 0
picks a free port (tests), read back from :attr:`ConsoleServer.port`. Every request passes the
``Host`` check of :mod:`agent.fleet.console.hosts` first (the pages, the API, /events and /metrics).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import uvicorn
from starlette.applications import Starlette

from agent.errors import ConfigError
from agent.fleet.console.hosts import HostCheck, allowed_names
from agent.secret_file import read_secret

#: Longest a stop waits for open requests (live event streams end within a second of the stop).
STOP_TIMEOUT_S = 5.0


class ConsoleServer:
    """A running console; :meth:`stop` ends it (open event streams first)."""

    def __init__(self, app: Starlette, sock: socket.socket, allowed_hosts: Sequence[str] = ()) -> None:
        self.app = app
        self._socket = sock
        self.host, self.port = sock.getsockname()[:2]
        self.host_check = HostCheck(app, allowed_names(self.host, allowed_hosts))
        config = uvicorn.Config(
            self.host_check,
            log_config=None,  # leave the controller's logging (structlog) as it is
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=int(STOP_TIMEOUT_S),
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="console-http", daemon=True)
        #: Called by :meth:`stop` after the server ended (what was started to serve it).
        self.on_stop: list[Callable[[], None]] = []

    def _run(self) -> None:
        # uvicorn installs no signal handlers outside the main thread: the controller keeps its own.
        self._server.run(sockets=[self._socket])

    @property
    def url(self) -> str:
        """``http://HOST:PORT`` (an IPv6 host in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def running(self) -> bool:
        """True while the server thread runs."""
        return self._thread.is_alive()

    def start(self, timeout: float = 10.0) -> None:
        """Start serving; returns once uvicorn accepts connections (or raises ConfigError)."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise ConfigError(f"console on {self.url} did not start; see the controller's log")
            time.sleep(0.02)

    def stop(self) -> None:
        """End the open event streams, then the server; waits at most :data:`STOP_TIMEOUT_S` + 1 s."""
        closing = getattr(self.app.state, "closing", None)
        if isinstance(closing, threading.Event):
            closing.set()
        self._server.should_exit = True
        self._thread.join(STOP_TIMEOUT_S + 1.0)
        self._socket.close()
        for done in self.on_stop:
            done()


def serve_console(
    app: Starlette, host: str = "127.0.0.1", port: int = 0, allowed_hosts: Sequence[str] = ()
) -> ConsoleServer:
    """Serve ``app`` on ``host:port`` in a background thread; the handle's ``stop()`` ends it.

    Binds loopback unless told otherwise (docs/console.md: put a TLS reverse proxy in front to
    reach it from elsewhere). Answers only requests whose ``Host`` is localhost, an IP address,
    ``host`` or one of ``allowed_hosts`` (403 otherwise). Raises ConfigError when the address cannot
    be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"console: cannot listen on {host}:{port} ({exc.strerror or exc}); "
            "pick another http.port or http.host in controller.yaml"
        ) from exc
    server = ConsoleServer(app, sock, allowed_hosts)
    server.start()
    return server


def console_token(path: Path | None) -> str | None:
    """The console token from ``http.token_file`` (None: no file configured, the console is read-only).

    Read with :func:`agent.secret_file.read_secret`: a missing or empty file is a ConfigError, and a
    file others may read is logged as a warning.
    """
    return None if path is None else read_secret(path)
