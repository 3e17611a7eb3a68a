"""The controller's web side: the console and ``/metrics`` on one HTTP server (the ``http:`` block of
controller.yaml), started only when a port is configured.

The ``fleet`` extra's web stack (starlette, uvicorn, prometheus_client) is imported inside
:func:`serve_http`, so a controller that serves no console never loads it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog

from agent.fleet.controller.calls import ConsoleCalls
from agent.fleet.controller.config import HttpSettings
from agent.fleet.rollout.store import RolloutStore
from agent.fleet.view.live import FleetView

if TYPE_CHECKING:
    from agent.fleet.console.server import ConsoleServer

log = structlog.get_logger(__name__)


def serve_http(
    view: FleetView,
    store: RolloutStore,
    calls: ConsoleCalls,
    settings: HttpSettings,
    *,
    engines: Callable[[], dict[str, Any]] | None = None,
) -> ConsoleServer:
    """Serve the console (its buttons are ``calls``) and ``/metrics`` over ``view`` and ``store``;
    ``engines()``: the fleet's engines for the console's engines page."""
    from agent.fleet.console.app import make_console_app
    from agent.fleet.console.server import console_token, serve_console
    from agent.fleet.metrics.exposition import fleet_metrics
    from agent.fleet.metrics.serving import metrics_asgi_app

    metrics = fleet_metrics(view, lambda: store.rollouts(limit=50), store.device_counts, store.change_mark)
    app = make_console_app(
        view,
        store,
        calls,
        token=console_token(settings.token_file),
        metrics_app=metrics_asgi_app(metrics),
        engines=engines,
    )
    server = serve_console(app, settings.host, settings.port or 0, settings.allowed_hosts)
    log.info("fleet.controller.http", url=server.url, token=settings.token_file is not None)
    return server
