"""The build claims this device holds: it was told to build an engine the whole fleet waits for.

While the build, the job's shadow and its probation run, a heartbeat renews the claim
(``up/engines/claim`` ``renew``, every ``renew_s`` the controller gave), so the controller knows the
builder is alive; a builder killed mid-build goes quiet and its claim expires at the controller,
which then tells the next asker to build. The claim ends here when the engine was stored
(:meth:`HeldClaims.settled`), or is released (``release``: the build failed, the INT8 check rejected
the engine, the job went on with another engine, ended without an offer, or the offer was refused),
so a waiting device takes it at once. Each claim remembers the job it was asked for: when that job
ends, every claim it still holds but the one it offers is released (:meth:`HeldClaims.release_job`).
A heartbeat stops by itself after ``hold_max_s`` (a path that never settles cannot renew forever)
or when the controller says the claim is no longer this device's.
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import structlog

from agent.engines.sharing.link import EngineRequests
from agent.errors import AgentError
from agent.protocol.engines import EngineClaim

log = structlog.get_logger(__name__)

#: Claims held at once (one per key this device builds for the fleet); more are not renewed.
MAX_HELD = 64
#: Bounds on the renewal period a controller may ask for.
_MIN_RENEW_S = 1.0
_MAX_RENEW_S = 600.0


@dataclass(frozen=True)
class _Held:
    stop: threading.Event
    job_id: str | None


class HeldClaims:
    """Heartbeats of the claims held (see the module docstring)."""

    def __init__(self, requests: EngineRequests, *, reply_timeout_s: float, hold_max_s: float) -> None:
        self._requests = requests
        self._reply_timeout_s = reply_timeout_s
        self._hold_max_s = hold_max_s
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}

    def holding(self, key: str) -> bool:
        with self._lock:
            return key in self._held

    def held(self) -> dict[str, str | None]:
        """The keys whose claims this device holds, each with the job it was asked for."""
        with self._lock:
            return {key: held.job_id for key, held in self._held.items()}

    def hold(self, key: str, claim: dict[str, Any], job_id: str | None = None) -> None:
        """The controller told this device to build ``key`` for ``job_id``: renew the claim until it ends."""
        try:
            renew_s = min(max(float(claim.get("renew_s") or 30.0), _MIN_RENEW_S), _MAX_RENEW_S)
        except (TypeError, ValueError):
            renew_s = 30.0
        stop = threading.Event()
        with self._lock:
            if key in self._held or len(self._held) >= MAX_HELD:
                return
            self._held[key] = _Held(stop, job_id)
        threading.Thread(
            target=self._renew, args=(key, stop, renew_s), name=f"engine-claim-{key[:8]}", daemon=True
        ).start()

    def _renew(self, key: str, stop: threading.Event, renew_s: float) -> None:
        waited = 0.0
        while not stop.wait(renew_s):
            waited += renew_s
            if waited > self._hold_max_s:
                log.warning("engine.fleet.claim_abandoned", key=key, held_s=round(waited))
                break
            try:
                reply = self._requests.request(
                    "claim", EngineClaim(key=key, action="renew"), self._reply_timeout_s
                )
            except (AgentError, OSError) as exc:  # the link refused it: the claim goes quiet
                log.warning("engine.fleet.claim_renew_failed", key=key, error=str(exc)[:300])
                break
            if reply is not None and reply.ok and not (reply.result or {}).get("held", True):
                log.warning("engine.fleet.claim_lost", key=key)  # expired there: another device builds
                break
        with self._lock:
            held = self._held.get(key)
            if held is not None and held.stop is stop:
                del self._held[key]

    def _stop(self, key: str) -> bool:
        with self._lock:
            held = self._held.pop(key, None)
        if held is None:
            return False
        held.stop.set()
        return True

    def settled(self, key: str) -> None:
        """The engine of ``key`` is stored at the controller (which ended the claim): stop renewing."""
        self._stop(key)

    def release(self, key: str, reason: str) -> None:
        """This device will offer no engine for ``key``: stop renewing and tell the controller (in the
        background: the caller goes on at once, whether or not the controller hears it)."""
        if not self._stop(key):
            return
        log.info("engine.fleet.claim_released", key=key, reason=reason[:300])
        release = EngineClaim(key=key, action="release", reason=reason[:300])
        threading.Thread(
            target=self._requests.request,
            args=("claim", release, self._reply_timeout_s),
            name=f"engine-release-{key[:8]}",
            daemon=True,
        ).start()

    def release_job(self, job_id: str, reason: str, *, keep: Collection[str] = ()) -> list[str]:
        """Job ``job_id`` is over here: release every claim it still holds but those in ``keep`` (the
        engine it offers); returns the keys released."""
        with self._lock:
            keys = [k for k, held in self._held.items() if held.job_id == job_id and k not in keep]
        for key in keys:
            self.release(key, reason)
        return keys
