"""The fleet console: a Starlette app with five pages, a JSON API, live events and its actions.

Routes (docs/console.md)::

    GET  /  /device/{id}  /rollouts  /engines  the pages (one HTML shell; static/console.js renders)
    GET  /static/...                          console.js, console.css, uPlot (vendored, no CDN)
    GET  /favicon.ico                         static/favicon.svg (no 404 in every page's log)
    GET  /api/devices?select=&state=&model=   the devices table (400 with the reason for a bad filter)
    GET  /api/device/{id}                     one device: slots, platform, jobs, the last hour's charts
    GET  /api/rollouts   /api/rollout/{id}    rollouts: waves, counts, gate figures, builds (+ devices)
    GET  /api/engines                         the fleet's engines per fingerprint (``fleet engines list``)
    GET  /enrollment  /api/enrollment         devices waiting for an operator, enrolled devices
    POST /api/enrollment/{id}/accept[?reenroll=1]|reject   the operator's decision (the token too)
    GET  /events?want=devices,rollouts&...    server-sent events (agent/fleet/console/feed.py)
    POST /api/rollouts/{id}/pause|resume|abort[?rollback=1]   needs ``Authorization: Bearer TOKEN``
    POST /api/devices/{id}/decommission       clears its retained topics, forgets it (the token too)
    POST /api/devices/{id}/snapshot[?stream=S]  the device's latest frame + its result (the token too)
    POST /api/devices/{id}/evidence/{job}     a rejected job's disagreement frames, both outputs (token)
    GET  /metrics                             the controller's metrics app, when given

Read-only unless a token is configured; then the actions need it, compared in constant time.
A Bearer header is never sent by a browser on its own, so a page on another site cannot make the
operator's browser pause a rollout (no cookie, no CSRF).
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agent.errors import AgentError, UsageError
from agent.fleet.console.feed import Feed, Stream
from agent.fleet.console.rollouts import rollout_devices, rollout_ids, rollout_summary
from agent.fleet.console.summary import DeviceFilter, device_detail, device_rows
from agent.fleet.rollout.building import Waits
from agent.fleet.rollout.store import RolloutNotFoundError, RolloutStore, RolloutStoreError
from agent.fleet.view.live import FleetView
from agent.transitions import IllegalTransitionError

STATIC_DIR = Path(__file__).parent / "static"

#: What every response carries: scripts and styles only from this server (a device string that
#: somehow reached the markup still could not run), no framing, no referrer to other sites.
SECURITY_HEADERS = (
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        b"connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
)

READ_ONLY_REFUSAL = (
    "actions are disabled: the controller has no console token "
    "(set http.token_file in controller.yaml; the console is read-only without it)"
)
#: A 401 says which: no token came (a script that forgot the header), or one that is not the console's.
AUTH_MISSING_REFUSAL = (
    "no token given: this action needs the console token (the content of the controller's "
    "http.token_file), sent as 'Authorization: Bearer TOKEN'"
)
AUTH_WRONG_REFUSAL = (
    "the token given is not this console's token (the content of the controller's http.token_file)"
)


class ConsoleActions(Protocol):
    """What the console's buttons do; the controller implements it on its running rollouts.

    Each returns a short message for the operator, or raises an :class:`AgentError` (an unknown
    rollout: 404) or a WrongStateError / :class:`IllegalTransitionError` (a move its state does not
    allow) whose text says why not; the console answers 409 with that text.
    """

    def pause(self, rollout_id: str) -> str: ...

    def resume(self, rollout_id: str) -> str: ...

    def abort(self, rollout_id: str, rollback: bool) -> str: ...

    def decommission(self, device_id: str) -> str: ...

    def snapshot(self, device_id: str, stream: str | None) -> dict[str, Any]: ...

    def evidence(self, device_id: str, job_id: str) -> dict[str, Any]: ...


class EnrollmentActions(Protocol):
    """The controller's enrollment desk as the console's enrollment page uses it (thread-safe).

    ``accept`` and ``reject`` raise an :class:`AgentError` whose ``code`` says why not
    (``not_pending``, ``reenroll_needed``, ``claim_used_up``); the console answers 409 with its text.
    """

    def pending_list(self) -> dict[str, Any]: ...

    def enrolled_list(self) -> dict[str, Any]: ...

    def accept(self, device_id: str, *, reenroll: bool = False) -> dict[str, Any]: ...

    def reject(self, device_id: str, reason: str) -> dict[str, Any]: ...


#: How a device's refusal of a snapshot is answered: its rate limit is the browser's 429 too.
_SNAPSHOT_STATUS = {
    "rate_limited": 429,
    "no_reply": 504,
    "offline": 504,
    "bad_snapshot": 502,
    "bad_evidence": 502,
}
#: Longest ``stream`` query value taken (a stream name is a topic level: short).
_MAX_STREAM = 128
#: Longest job id taken in the evidence route (the device refuses longer ones too).
_MAX_JOB_ID = 128


class _SecurityHeaders:
    """Adds :data:`SECURITY_HEADERS` to every HTTP response (a plain ASGI wrapper: it leaves
    streaming responses streaming, which Starlette's BaseHTTPMiddleware would not)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, send_with_headers)


class _AsgiEndpoint:
    """An ASGI app as a Route endpoint: Starlette calls a plain *function* endpoint as
    ``f(request) -> response``, and prometheus_client's ``make_asgi_app`` returns a function."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def token_given(authorization: str | None) -> bool:
    """Whether an ``Authorization`` header carries anything beyond a bare ``Bearer`` (a wrong token
    then, when it does not match: another scheme or a malformed header is not the console's token)."""
    given = (authorization or "").strip()
    return bool(given) and given.lower() != "bearer"


def token_matches(configured: str | None, authorization: str | None) -> bool:
    """Whether an ``Authorization`` header carries the configured token (constant-time compare)."""
    if not configured or not authorization:
        return False
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), configured.encode())


def make_console_app(
    view: FleetView,
    store: RolloutStore,
    actions: ConsoleActions,
    *,
    token: str | None,
    metrics_app: ASGIApp | None = None,
    interval_s: float = 1.0,
    engines: Callable[[], dict[str, Any]] | None = None,
    waits: Callable[[], Waits] | None = None,
    enrollment: EnrollmentActions | None = None,
) -> Starlette:
    """The console over ``view`` (devices) and ``store`` (rollouts); ``actions`` behind ``token``.

    ``token`` None or empty: read-only, every action answers 403. ``metrics_app`` is served at
    ``/metrics``. ``interval_s``: the shortest time between two live frames to one browser.
    ``engines()``: the controller's engine listing (the ``engines`` verb's answer); None: the engines
    page says this console has none. ``waits()``: the devices waiting for another device's build (the
    controller's build claims), for the rollouts page's building devices. ``enrollment``: the
    controller's enrollment desk (None: the enrollment page says this console has none).
    """
    feed = Feed(view, store, interval_s=interval_s, waits=waits)
    closing = threading.Event()
    # One snapshot in flight per device: a double click, or two tabs, wait for the first answer.
    snapshots_lock = threading.Lock()
    snapshots_running: set[str] = set()

    async def page(request: Request) -> Response:
        return FileResponse(STATIC_DIR / "index.html", headers={"cache-control": "no-store"})

    async def favicon(request: Request) -> Response:
        # Browsers ask for /favicon.ico whatever the page links: answer it rather than log a 404.
        return FileResponse(STATIC_DIR / "favicon.svg", media_type="image/svg+xml")

    # The API handlers are plain functions: Starlette runs them in its thread pool, so a SQLite read
    # or copying 1,000 devices never stalls the event loop that carries the live streams.
    def api_devices(request: Request) -> Response:
        try:
            where = DeviceFilter.parse(request.query_params)
        except (UsageError, ValueError) as exc:
            return _error(400, str(exc))
        devices = view.devices()
        rows = device_rows(devices, where)
        return JSONResponse({"devices": list(rows.values()), "total": len(devices), "version": view.version})

    def api_device(request: Request) -> Response:
        device_id = request.path_params["device_id"]
        device = view.device(device_id)
        if device is None:
            return _error(404, f"no device {device_id!r} heard by this controller")
        return JSONResponse(device_detail(device, view.history(device_id), view.history_since()))

    def api_rollouts(request: Request) -> Response:
        try:
            builds, waiting = view.builds(), waits() if waits is not None else None
            return JSONResponse(
                {
                    "rollouts": [
                        rollout_summary(store, r, builds=builds, waits=waiting) for r in rollout_ids(store)
                    ]
                }
            )
        except RolloutStoreError as exc:
            return _error(503, str(exc))

    def api_rollout(request: Request) -> Response:
        rollout_id = request.path_params["rollout_id"]
        try:
            waiting = waits() if waits is not None else None
            summary = rollout_summary(store, rollout_id, builds=view.builds(), waits=waiting)
            summary["device_rows"] = rollout_devices(store, rollout_id)
        except RolloutStoreError as exc:
            return _error(404, str(exc))
        return JSONResponse(summary)

    def api_engines(request: Request) -> Response:
        if engines is None:
            return _error(404, "this console serves no engine store (run it in the fleet controller)")
        return JSONResponse(engines(), headers={"cache-control": "no-store"})

    def api_enrollment(request: Request) -> Response:
        if enrollment is None:
            return _error(404, "enrollment is off on this controller (set enrollment.ca_dir)")
        listing = {**enrollment.pending_list(), **enrollment.enrolled_list()}
        return JSONResponse(listing, headers={"cache-control": "no-store"})

    def decide(request: Request) -> Response:
        refused = refusal(request)
        if refused is not None:
            return refused
        if enrollment is None:
            return _error(404, "enrollment is off on this controller (set enrollment.ca_dir)")
        device_id, verb = request.path_params["device_id"], request.path_params["verb"]
        try:
            if verb == "accept":
                reenroll = request.query_params.get("reenroll", "") in ("1", "true", "yes")
                done = enrollment.accept(device_id, reenroll=reenroll)
                message = f"{device_id} accepted: certificate {done['serial']}" + (
                    " (accepted already)" if done["already"] else ""
                )
            elif verb == "reject":
                enrollment.reject(device_id, request.query_params.get("reason", "")[:200])
                message = f"{device_id} rejected"
            else:
                return _error(404, f"no action {verb!r}: accept or reject")
        except AgentError as exc:
            return _error(409, str(exc))
        return JSONResponse({"ok": True, "message": message})

    def refusal(request: Request) -> Response | None:
        """The answer to an action without the token (None: it carries the token)."""
        if not token:
            return _error(403, READ_ONLY_REFUSAL)
        authorization = request.headers.get("authorization")
        if not token_matches(token, authorization):
            response = _error(401, AUTH_WRONG_REFUSAL if token_given(authorization) else AUTH_MISSING_REFUSAL)
            response.headers["www-authenticate"] = 'Bearer realm="edge-agent console"'
            return response
        return None

    def act(request: Request) -> Response:
        refused = refusal(request)
        if refused is not None:
            return refused
        rollout_id, verb = request.path_params["rollout_id"], request.path_params["verb"]
        if verb not in ("pause", "resume", "abort"):
            return _error(404, f"no action {verb!r}: pause, resume or abort")
        rollback = request.query_params.get("rollback", "") in ("1", "true", "yes")
        try:
            if verb == "pause":
                message = actions.pause(rollout_id)
            elif verb == "resume":
                message = actions.resume(rollout_id)
            else:
                message = actions.abort(rollout_id, rollback)
        except RolloutNotFoundError as exc:
            return _error(404, str(exc))
        except (AgentError, IllegalTransitionError) as exc:
            return _error(409, str(exc))
        return JSONResponse({"ok": True, "message": message})

    def decommission(request: Request) -> Response:
        refused = refusal(request)
        if refused is not None:
            return refused
        try:
            message = actions.decommission(request.path_params["device_id"])
        except AgentError as exc:  # online (stop its agent first), a bad id, the broker unreachable
            return _error(409, str(exc))
        return JSONResponse({"ok": True, "message": message})

    def snapshot(request: Request) -> Response:
        refused = refusal(request)
        if refused is not None:
            return refused
        device_id = request.path_params["device_id"]
        stream = request.query_params.get("stream") or None
        if stream is not None and len(stream) > _MAX_STREAM:
            return _error(400, f"stream: at most {_MAX_STREAM} characters")
        if view.device(device_id) is None:
            return _error(404, f"no device {device_id!r} heard by this controller")
        with snapshots_lock:
            if device_id in snapshots_running:
                return _error(429, f"a snapshot of {device_id} is already being taken; wait for it")
            snapshots_running.add(device_id)
        try:
            taken = actions.snapshot(device_id, stream)
        except AgentError as exc:  # the device's refusal (rate_limited, no_frame ...) or no reply
            return _error(_SNAPSHOT_STATUS.get(exc.code, 409), str(exc))
        finally:
            with snapshots_lock:
                snapshots_running.discard(device_id)
        return JSONResponse({"ok": True, "snapshot": taken}, headers={"cache-control": "no-store"})

    def evidence(request: Request) -> Response:
        refused = refusal(request)
        if refused is not None:
            return refused
        device_id, job_id = request.path_params["device_id"], request.path_params["job_id"]
        if len(job_id) > _MAX_JOB_ID:
            return _error(400, f"job id: at most {_MAX_JOB_ID} characters")
        if view.device(device_id) is None:
            return _error(404, f"no device {device_id!r} heard by this controller")
        # The same one-at-a-time guard as snapshots: each costs the device several replies.
        with snapshots_lock:
            if device_id in snapshots_running:
                return _error(429, f"a request to {device_id} is already running; wait for it")
            snapshots_running.add(device_id)
        try:
            found = actions.evidence(device_id, job_id)
        except AgentError as exc:  # no_evidence, no reply, a junk reply
            status = 404 if exc.code == "no_evidence" else _SNAPSHOT_STATUS.get(exc.code, 409)
            return _error(status, str(exc))
        finally:
            with snapshots_lock:
                snapshots_running.discard(device_id)
        return JSONResponse({"ok": True, "evidence": found}, headers={"cache-control": "no-store"})

    async def events(request: Request) -> Response:
        params = request.query_params
        try:
            where = DeviceFilter.parse(params)
        except (UsageError, ValueError) as exc:
            return _error(400, str(exc))
        want = set(params.get("want", "devices").split(","))
        stream = Stream(
            feed,
            where,
            device=params.get("device") or None,
            want_devices="devices" in want,
            want_rollouts="rollouts" in want,
        )
        return StreamingResponse(
            stream.run(closing, request.is_disconnected),
            media_type="text/event-stream",
            headers={"cache-control": "no-store", "x-accel-buffering": "no"},
        )

    routes: list[Any] = [
        Route("/", page),
        Route("/device/{device_id}", page),
        Route("/rollouts", page),
        Route("/engines", page),
        Route("/enrollment", page),
        Route("/favicon.ico", favicon),
        Route("/api/devices", api_devices),
        Route("/api/device/{device_id}", api_device),
        Route("/api/rollouts", api_rollouts),
        Route("/api/rollout/{rollout_id}", api_rollout),
        Route("/api/engines", api_engines),
        Route("/api/enrollment", api_enrollment),
        Route("/api/enrollment/{device_id}/{verb}", decide, methods=["POST"]),
        Route("/api/rollouts/{rollout_id}/{verb}", act, methods=["POST"]),
        Route("/api/devices/{device_id}/decommission", decommission, methods=["POST"]),
        Route("/api/devices/{device_id}/snapshot", snapshot, methods=["POST"]),
        Route("/api/devices/{device_id}/evidence/{job_id}", evidence, methods=["POST"]),
        Route("/events", events),
        Mount("/static", StaticFiles(directory=STATIC_DIR)),
    ]
    if metrics_app is not None:
        # A Route, not a Mount: Prometheus scrapes /metrics itself, without a redirect to /metrics/.
        routes.append(Route("/metrics", _AsgiEndpoint(metrics_app)))
    app = Starlette(routes=routes)
    app.add_middleware(_SecurityHeaders)
    app.state.closing = closing  # set by serve_console's stop(): open event streams end
    return app
