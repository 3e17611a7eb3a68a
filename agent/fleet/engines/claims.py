"""Build claims: one build per engine cache key for the whole fleet (docs/engines.md, "One build per
key, not one per asker").

The first device that asks for a key nobody holds or builds is told to build it: it holds the key's
**claim**. Every other device asking for that key meanwhile is told who builds it since when, and
to ask again after ``retry_s`` (its model keeps serving). A claim ends when the engine is stored,
when its holder releases it (its build failed, the INT8 check rejected the engine, its job went on
with another engine or ended without an offer), when the holder's job is heard ending without
ACTIVE or ACTIVE without offering this key for ``quiet_s``, when the holder is quiet (no ask, no
renewal) for ``quiet_s``, or when the operator releases it (``fleet engines release``): then the
next asker gets it.

:class:`ClaimBook` decides; it keeps no clock of its own (``now``: monotonic seconds, passed in) and
nothing unbounded: at most ``max_claims`` claims (more askers than that build without one, as before
claims existed) and :data:`MAX_WAITERS` waiting devices counted per claim.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, ParamSpec, TypeVar

#: Waiting devices remembered per claim (only to spread their re-asks: more are not counted).
MAX_WAITERS = 10_000
#: Re-asks per second per claim the controller aims at: the suggested wait grows with the waiters.
ASKS_PER_S = 50.0
#: Longest wait between two asks a controller suggests.
MAX_RETRY_S = 60.0


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _locked(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run ``method`` under the book's lock (the desk's thread decides, the listing reads elsewhere)."""

    @functools.wraps(method)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        book: Any = args[0]
        with book._lock:
            return method(*args, **kwargs)

    return run


@dataclass
class Claim:
    """One key being built: by which device, for which job, since when, last heard when."""

    key: str
    device: str
    job_id: str | None
    fingerprint: str
    since: float  # Unix seconds (shown)
    heard: float  # monotonic seconds (expiry)
    waiters: set[str] = field(default_factory=set)
    #: When each waiter first asked (monotonic seconds): how long it has waited for this build.
    waiting_since: dict[str, float] = field(default_factory=dict)
    #: When the controller first heard the holder's job ACTIVE (monotonic seconds): it offers soon
    #: after, or never (it went ACTIVE on another engine).
    active_seen: float | None = None
    #: What the builder said it builds: model, version, precision (shown; None when not said).
    model_id: str | None = None
    version: str | None = None
    precision: str | None = None


@dataclass(frozen=True)
class Decision:
    """What an ask without a stored engine is answered: ``build`` (the asker holds the claim),
    ``wait`` (another device builds it: ask again after ``retry_s``), or ``build_unclaimed`` (build
    without a claim: too many claims, or ``freed``: it waited for a builder that gave up)."""

    kind: Literal["build", "wait", "build_unclaimed"]
    claim: Claim | None
    retry_s: float = 0.0
    freed: bool = False


#: ``ended(claim)``: why the holder's build is over though it never said so (its job ended without
#: ACTIVE ...), or None while it may still offer.
EndedFn = Callable[[Claim], str | None]


class ClaimBook:
    """The live claims, one per key (see the module docstring)."""

    def __init__(self, *, quiet_s: float, max_claims: int, retry_s: float) -> None:
        self.quiet_s = quiet_s
        self.max_claims = max_claims
        self.retry_s = retry_s
        self._claims: dict[str, Claim] = {}
        self._lock = threading.RLock()
        self.ended: list[tuple[str, str, str]] = []  # (key, device, why): the last few, for the log
        #: Per key whose holder gave up, the devices that waited for it: the first of them to ask again
        #: takes the claim, the others build at once rather than each waiting for the one before.
        self._freed: dict[str, set[str]] = {}
        self.stats = {
            "granted": 0,
            "waits": 0,
            "expired": 0,
            "released": 0,
            "unclaimed": 0,
            "operator_released": 0,
            "job_ended": 0,
            "stored": 0,
        }

    def __len__(self) -> int:
        return len(self._claims)

    @_locked
    def get(self, key: str) -> Claim | None:
        return self._claims.get(key)

    @_locked
    def ask(
        self,
        key: str,
        device: str,
        *,
        job_id: str | None,
        fingerprint: str,
        now: float,
        ended: EndedFn | None = None,
        model: tuple[str | None, str | None, str | None] = (None, None, None),
    ) -> Decision:
        """``device`` asks for ``key`` and the fleet holds no such engine: who builds it. ``model``: the
        model, version and precision the asker said it wants (kept with a claim it gets)."""
        claim = self._claims.get(key)
        if claim is not None:
            why = self._over(claim, now, ended)
            if why is not None:
                self._end(claim, why)
                claim = None
        if claim is not None and claim.device == device:
            # The holder asks again (a restart, a retried job): it still builds. Its ask is a heartbeat.
            claim.heard = now
            if job_id and job_id != claim.job_id:
                claim.job_id, claim.active_seen = job_id, None
            return Decision("build", claim)
        freed = self._freed.get(key)
        if claim is not None and freed is not None and device in freed:
            freed.discard(device)
            self.stats["unclaimed"] += 1
            return Decision("build_unclaimed", None, freed=True)
        if claim is not None:
            if len(claim.waiters) < MAX_WAITERS:
                claim.waiters.add(device)
                claim.waiting_since.setdefault(device, now)
            self.stats["waits"] += 1
            return Decision("wait", claim, self.retry_for(claim))
        self.expire(now, ended)
        if len(self._claims) >= self.max_claims:
            self.stats["unclaimed"] += 1
            return Decision("build_unclaimed", None)
        if freed is not None:
            freed.discard(device)
        claim = Claim(key, device, job_id, fingerprint, time.time(), now)
        claim.model_id, claim.version, claim.precision = model
        self._claims[key] = claim
        self.stats["granted"] += 1
        return Decision("build", claim)

    def retry_for(self, claim: Claim) -> float:
        """Seconds a waiter waits before it asks again: ``retry_s``, longer as waiters grow (so the
        controller hears about :data:`ASKS_PER_S` asks a second per key), at most :data:`MAX_RETRY_S`."""
        return round(min(MAX_RETRY_S, max(self.retry_s, len(claim.waiters) / ASKS_PER_S)), 1)

    @_locked
    def renew(self, key: str, device: str, now: float, ended: EndedFn | None = None) -> bool:
        """The holder's heartbeat: True when ``device`` holds ``key``'s claim (now renewed); False,
        the claim ended, when ``ended`` says the holder's job is over (it stops renewing then)."""
        claim = self._claims.get(key)
        if claim is None or claim.device != device:
            return False
        why = ended(claim) if ended is not None else None
        if why is not None:
            self.stats["job_ended"] += 1
            self._end(claim, why)
            return False
        claim.heard = now
        return True

    @_locked
    def release(self, key: str, device: str, reason: str) -> bool:
        """The holder gave up without an engine: the claim ends (True), the next asker builds."""
        claim = self._claims.get(key)
        if claim is None or claim.device != device:
            return False
        self._end(claim, f"released: {reason}"[:300])
        self._free(claim)
        self.stats["released"] += 1
        return True

    @_locked
    def matching(self, key: str) -> list[Claim]:
        """The live claims whose key is ``key`` or starts with it (the listing shows 12 characters)."""
        exact = self._claims.get(key)
        if exact is not None:
            return [exact]
        return [c for c in self._claims.values() if key and c.key.startswith(key)]

    @_locked
    def withdraw(self, key: str, why: str) -> Claim | None:
        """The operator ends ``key``'s claim whoever holds it (the holder hears so at its next renewal);
        the claim ended, or None when there was none."""
        claim = self._claims.get(key)
        if claim is None:
            return None
        self._end(claim, f"released by the operator: {why}"[:300])
        self._free(claim)
        self.stats["operator_released"] += 1
        return claim

    @_locked
    def settled(self, key: str) -> None:
        """The engine of ``key`` is stored: its claim, if any, is over (waiters download it now)."""
        self._freed.pop(key, None)  # they download it now
        claim = self._claims.pop(key, None)
        if claim is not None:
            self.stats["stored"] += 1
            self._remember(claim, "stored")

    @_locked
    def expire(self, now: float, ended: EndedFn | None = None) -> list[Claim]:
        """End every claim whose holder went quiet or whose job ended; returns them."""
        gone = []
        for claim in list(self._claims.values()):
            why = self._over(claim, now, ended)
            if why is not None:
                self._end(claim, why)
                gone.append(claim)
        return gone

    @_locked
    def waiting(self, now: float) -> dict[str, tuple[str, float]]:
        """Each device waiting for a claimed build: (the device building it, seconds waited so far)."""
        return {
            device: (claim.device, round(now - since, 1))
            for claim in self._claims.values()
            for device, since in claim.waiting_since.items()
        }

    @_locked
    def live(self, now: float) -> list[Claim]:
        """The claims still running, oldest first."""
        return sorted(self._claims.values(), key=lambda c: c.since)

    def _over(self, claim: Claim, now: float, ended: EndedFn | None) -> str | None:
        if now - claim.heard > self.quiet_s:
            self.stats["expired"] += 1
            return f"its builder was quiet for {now - claim.heard:.0f}s (more than {self.quiet_s:.0f}s)"
        why = ended(claim) if ended is not None else None
        if why is not None:
            self.stats["job_ended"] += 1
        return why

    def _end(self, claim: Claim, why: str) -> None:
        self._claims.pop(claim.key, None)
        self._remember(claim, why)

    def _free(self, claim: Claim) -> None:
        """Its holder gave up: its waiters need not wait for one another (bounded as the claims are)."""
        if not claim.waiters:
            return
        self._freed.pop(claim.key, None)
        self._freed[claim.key] = set(claim.waiters)
        while len(self._freed) > self.max_claims:
            del self._freed[next(iter(self._freed))]

    def _remember(self, claim: Claim, why: str) -> None:
        self.ended.append((claim.key, claim.device, why))
        del self.ended[:-32]
