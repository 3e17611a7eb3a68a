"""The controller's web side: the console and ``/metrics`` on one HTTP server (the ``http:`` block of
controller.yaml), started only when a port is configured.

The ``fleet`` extra's web stack (starlette, uvicorn, prometheus_client) is imported inside
:func:`serve_http`, so a controller that serves no console never loads it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog

from agent.fleet.controller.calls import ConsoleCalls
from agent.fleet.controller.config import HttpSettings
from agent.fleet.engines.desk import EngineDesk
from agent.fleet.enrollment.desk import EnrollmentDesk
from agent.fleet.metrics.engine_series import EngineFigures
from agent.fleet.metrics.enroll_series import EnrollFigures
from agent.fleet.metrics.intake_series import IntakeFn
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
    desk: EngineDesk | None = None,
    enrollment: EnrollmentDesk | None = None,
    intake: IntakeFn | None = None,
) -> ConsoleServer:
    """Serve the console (its buttons are ``calls``) and ``/metrics`` over ``view`` and ``store``;
    ``engines()``: the fleet's engines for the console's engines page; ``desk``: the engine desk
    whose engines and claims ``/metrics`` shows; ``enrollment``: the enrollment desk (its counts on
    ``/metrics``, its pending list on the console); ``intake``: the controller's message counters."""
    from agent.fleet.console.app import make_console_app
    from agent.fleet.console.server import console_token, serve_console
    from agent.fleet.metrics.exposition import fleet_metrics
    from agent.fleet.metrics.serving import metrics_asgi_app

    metrics = fleet_metrics(
        view,
        lambda: store.rollouts(limit=50),
        store.device_counts,
        store.change_mark,
        rollout_waves=store.wave_rows,
        rollout_changed=store.last_change,
        engines=None if desk is None else lambda: engine_figures(desk),
        enrollment=None if enrollment is None else lambda: enroll_figures(enrollment),
        intake=intake,
    )
    app = make_console_app(
        view,
        store,
        calls,
        token=console_token(settings.token_file),
        metrics_app=metrics_asgi_app(metrics),
        engines=engines,
        waits=None if desk is None else lambda: desk.claims.waiting(time.monotonic()),
        enrollment=enrollment,
    )
    server = serve_console(app, settings.host, settings.port or 0, settings.allowed_hosts)
    server.on_stop.append(metrics.keep_warm())
    log.info("fleet.controller.http", url=server.url, token=settings.token_file is not None)
    return server


def engine_figures(desk: EngineDesk) -> EngineFigures:
    """What ``/metrics`` shows of the engine desk now: engines held and withdrawn, claims held, the
    oldest's age, the devices waiting, and the claims ended since start by why."""
    now = time.monotonic()
    live = desk.live_claims(now)
    stats = desk.claims.stats
    ended = {
        "stored": stats["stored"],
        "released": stats["released"],
        "expired": stats["expired"],
        "job_ended": stats["job_ended"],
        "operator": stats["operator_released"],
    }
    return EngineFigures(
        stored=len(desk.store.entries()),
        stored_bytes=desk.store.total_bytes(),
        withdrawn=len(desk.store.withdrawn()),
        claims=len(live),
        oldest_claim_age_s=max((time.time() - c.since for c in live), default=0.0),
        waiting=sum(len(c.waiters) for c in live),
        ended=ended,
    )


def enroll_figures(desk: EnrollmentDesk) -> EnrollFigures:
    """What ``/metrics`` shows of the enrollment desk now."""
    book = desk.book
    return EnrollFigures(
        pending=0 if book is None else book.pending_total(),
        enrolled=0 if book is None else book.enrolled_total(),
        dropped=desk.dropped,
        outcomes=dict(desk.outcomes),
        refusals=dict(desk.refusals),
    )
