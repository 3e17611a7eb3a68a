"""Serving the controller's ``/metrics``: a plain HTTP server (:func:`serve_metrics`, no console) or
the ASGI app the console mounts (:func:`metrics_asgi_app`); both gzip the answer when the scraper
accepts it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from agent.fleet.metrics.exposition import FleetMetrics, RolloutCounts, Rollouts, RolloutsMark, fleet_metrics
from agent.fleet.metrics.text import CONTENT_TYPE
from agent.fleet.view.live import FleetView


def _answer(metrics: FleetMetrics, accept_encoding: str) -> tuple[bytes, list[tuple[str, str]]]:
    """The body and headers of one scrape: gzipped when the scraper accepts it (Prometheus does)."""
    headers = [("Content-Type", CONTENT_TYPE)]
    if "gzip" in accept_encoding:
        body = metrics.render_gzip()
        headers.append(("Content-Encoding", "gzip"))
    else:
        body = metrics.render()
    headers.append(("Content-Length", str(len(body))))
    return body, headers


def metrics_asgi_app(metrics: FleetMetrics) -> Any:
    """The ASGI app serving ``metrics`` (the console mounts it at ``/metrics``); it renders in a
    worker thread, so a scrape never blocks the console's event loop."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            return
        accept = ""
        for name, value in scope.get("headers", []):
            if name.lower() == b"accept-encoding":
                accept = value.decode("latin-1")
        body, headers = await asyncio.to_thread(_answer, metrics, accept)
        raw = [(k.lower().encode(), v.encode()) for k, v in headers]
        await send({"type": "http.response.start", "status": 200, "headers": raw})
        await send({"type": "http.response.body", "body": b"" if scope.get("method") == "HEAD" else body})

    return app


class MetricsServer:
    """``serve_metrics``'s result: the port it got and a :meth:`stop`."""

    def __init__(
        self, server: ThreadingHTTPServer, thread: threading.Thread, stop_warm: Callable[[], None]
    ) -> None:
        self._server = server
        self._thread = thread
        self._stop_warm = stop_warm

    @property
    def port(self) -> int:
        return int(self._server.server_port)

    def stop(self) -> None:
        self._stop_warm()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)


def serve_metrics(
    view: FleetView,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    rollouts: Rollouts | None = None,
    rollout_counts: RolloutCounts | None = None,
    rollouts_mark: RolloutsMark | None = None,
) -> MetricsServer:
    """Serve the fleet's ``/metrics`` on ``host:port`` (0: a free port) in a daemon thread, no console."""
    metrics = fleet_metrics(view, rollouts, rollout_counts, rollouts_mark)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body, headers = _answer(metrics, self.headers.get("Accept-Encoding", ""))
            self.send_response(200)
            for name, value in headers:
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per scrape on stderr is noise

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="fleet-metrics", daemon=True)
    thread.start()
    return MetricsServer(server, thread, metrics.keep_warm())
