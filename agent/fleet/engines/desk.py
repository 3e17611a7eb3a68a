"""The controller's answers to the devices' engine requests (``{prefix}/{device}/up/engines/{verb}``).

- ``ask``: the signed record of the engine with that key; else "build it" to the first asker (a build
  claim: :mod:`.claims`) and "being built by D since T, ask again in S" to the others;
- ``claim``: the builder's heartbeat (``renew``) or its giving up (``release``);
- ``offer``: which of the engine's files to upload (the trust checks first: :mod:`.trust`), and once
  they are all here, the engine is vouched for (signed) and stored;
- ``piece``: one piece of one offered file (the upload path of ``fleet rollout start``);
- ``drop``: the engine failed on a device: it is withdrawn fleet-wide when it is the one stored.

Requests are queued by the MQTT dispatcher (bounded: a full queue drops, the device's bounded wait
ends and it builds) and answered on the desk's own thread, so an upload never delays a rollout
step. A reply goes only to the requesting device's own ``down/engines/reply`` topic. Everything a
device sends is bounded: the models' sizes (:mod:`agent.protocol.engines`), one upload in progress
per device, at most ``engines.max_uploads`` at once, each given up after :data:`UPLOAD_IDLE_S` quiet.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
from pydantic import ValidationError

from agent.errors import AgentError
from agent.fleet.base.untrusted import shown
from agent.fleet.engines.claims import Claim, ClaimBook
from agent.fleet.engines.settings import EngineShareSettings
from agent.fleet.engines.store import EngineStore
from agent.fleet.engines.trust import JobFacts, missing_files, offer_refusal, sign_record, withdraws
from agent.mqtt.core import PublishProperties
from agent.mqtt.inbound import InboundMessage
from agent.protocol.engines import (
    ClaimListed,
    EngineAsk,
    EngineClaim,
    EngineDrop,
    EngineListed,
    EngineOffer,
    EngineRecord,
)
from agent.protocol.messages import CommandReply, JobState, encode
from agent.protocol.topics import Topics, parse
from agent.signing import Ed25519PrivateKey

log = structlog.get_logger(__name__)

#: An upload with no piece for this long is given up (its partial files are collected).
UPLOAD_IDLE_S = 600.0
#: Largest request payload taken (a piece is 256 KiB; an offer's sidecar a few kilobytes).
MAX_REQUEST_BYTES = 2 * 1024 * 1024

Publish = Callable[[str, bytes, PublishProperties], None]
#: Job states after which a claim holder may still offer (its job has not ended).
_STILL_RUNNING = frozenset(s.value for s in JobState if not s.terminal)


class PieceSink(Protocol):
    """Where upload pieces go: the controller's :class:`~agent.fleet.controller.upload.UploadSink` on the
    blobs directory (passed in: the upload path belongs to the controller, which builds the desk)."""

    def take(self, data: bytes, properties: dict[str, str]) -> dict[str, Any]: ...


#: ``job_facts(device, job_id)``: what the controller heard of that job (None: nothing).
JobFactsFn = Callable[[str, str], JobFacts | None]


class EngineRequestError(AgentError):
    """A device's engine request the controller refuses (the reply names why)."""

    code = "engines"


class UnknownClaimError(AgentError):
    """``fleet engines release``: no live claim on that key."""

    code = "unknown_claim"


class AmbiguousClaimError(AgentError):
    """``fleet engines release``: the key given starts several claims' keys."""

    code = "ambiguous_key"


@dataclass
class _Upload:
    offer: EngineOffer
    wanted: dict[str, int]  # sha256 -> size
    touched: float = field(default_factory=time.monotonic)


class EngineDesk:
    """Answers engine requests (see the module docstring): ``take`` on the dispatcher, ``start``/``stop``."""

    def __init__(
        self,
        settings: EngineShareSettings,
        store: EngineStore,
        *,
        prefix: str,
        signing_key: Ed25519PrivateKey | None,
        key_id: str | None,
        publish: Publish,
        job_facts: JobFactsFn,
        sink: PieceSink,
    ) -> None:
        self.settings = settings
        self.store = store
        self.prefix = prefix
        self._key = signing_key
        self._key_id = key_id
        self._publish = publish
        self._job_facts = job_facts
        self._sink = sink
        self._uploads: dict[str, _Upload] = {}
        self._queue: queue.Queue[InboundMessage | None] = queue.Queue(maxsize=settings.queue)
        self._thread: threading.Thread | None = None
        self.claims = ClaimBook(
            quiet_s=settings.claim_quiet_s, max_claims=settings.max_claims, retry_s=settings.claim_retry_s
        )
        self.stats = {"asks": 0, "found": 0, "stored": 0, "withdrawn": 0, "refused": 0, "dropped_requests": 0}

    @property
    def can_vouch(self) -> bool:
        """Whether this controller can sign engines (without a key it never shares)."""
        return self._key is not None and bool(self._key_id)

    # -- lifecycle ------------------------------------------------------------------------------------

    def start(self) -> None:
        self.store.create()
        for stale in self.store.blobs.glob(".upload-*.part"):
            with contextlib.suppress(OSError):
                stale.unlink()  # an upload the previous process was taking: the device offers again
        self._thread = threading.Thread(target=self._run, name="engine-desk", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        if self._thread is None:
            return
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout)
        self._thread.join(timeout)
        self._thread = None

    def take(self, message: InboundMessage) -> bool:
        """Dispatcher thread: queue ``message`` when it is an engine request (True), else False."""
        if "/up/engines/" not in message.topic:
            return False
        try:
            self._queue.put_nowait(message)
        except queue.Full:
            self.stats["dropped_requests"] += 1
        return True

    def _run(self) -> None:
        while True:
            message = self._queue.get()
            if message is None:
                return
            try:
                self._answer(message)
            except Exception:  # the desk outlives any one request
                log.exception("fleet.engines.request_failed", topic=shown(message.topic, 200))

    # -- requests -------------------------------------------------------------------------------------

    def _answer(self, message: InboundMessage) -> None:
        try:
            parsed = parse(message.topic, self.prefix)
        except ValueError:
            return
        device, verb = parsed.device, parsed.arg or ""
        reply_topic = Topics(self.prefix, device).engines_reply
        if message.response_topic != reply_topic:
            return  # answers go to the asking device only
        try:
            result = self.handle(device, verb, message.payload, dict(message.user_properties))
            reply = CommandReply(command=f"engines/{verb}", ok=True, result=result)
        except (AgentError, ValidationError, ValueError) as exc:
            self.stats["refused"] += 1
            code = exc.code if isinstance(exc, AgentError) else "bad_request"
            reply = CommandReply(command=f"engines/{verb}", ok=False, error_code=code, error=str(exc)[:500])
        properties = PublishProperties(correlation_data=message.correlation_data)
        self._publish(reply_topic, encode(reply), properties)

    def handle(self, device: str, verb: str, payload: bytes, properties: dict[str, str]) -> dict[str, Any]:
        """One request's result; raises to refuse (the reply carries the reason)."""
        if len(payload) > MAX_REQUEST_BYTES:
            raise EngineRequestError(f"request of {len(payload)} bytes, more than {MAX_REQUEST_BYTES}")
        if verb == "ask":
            return self.ask(device, EngineAsk.model_validate_json(payload))
        if verb == "offer":
            return self.offer(device, EngineOffer.model_validate_json(payload))
        if verb == "piece":
            return self.piece(device, payload, properties)
        if verb == "drop":
            return self.drop(device, EngineDrop.model_validate_json(payload))
        if verb == "claim":
            return self.claim(device, EngineClaim.model_validate_json(payload))
        raise EngineRequestError(f"unknown engines verb {shown(verb, 32)}")

    def ask(self, device: str, ask: EngineAsk) -> dict[str, Any]:
        self.stats["asks"] += 1
        if not self.can_vouch:
            return {"found": False, "reason": "this controller has no signing key: it shares no engines"}
        entry = self.store.get(ask.key)
        if entry is not None:
            self.stats["found"] += 1
            self.store.used(ask.key, device)
            return {"found": True, "engine": entry.signed.model_dump(mode="json")}
        decision = self.claims.ask(
            ask.key,
            device,
            job_id=ask.job_id,
            fingerprint=ask.fingerprint or "",
            now=time.monotonic(),
            ended=self._claim_ended,
            model=(ask.model_id, ask.version, ask.precision),
        )
        key = ask.key[:12]
        if decision.kind == "build_unclaimed" and decision.freed:
            return {
                "found": False,
                "build": True,
                "reason": f"the device building engine {key} gave up while you waited: build it here",
            }
        if decision.kind == "build_unclaimed":
            return {
                "found": False,
                "build": True,
                "reason": f"the fleet holds no engine {key}, and {len(self.claims)} builds are claimed "
                "already: build it here",
            }
        claim = decision.claim
        assert claim is not None
        if decision.kind == "build":
            quiet = self.claims.quiet_s
            return {
                "found": False,
                "build": True,
                "reason": f"the fleet holds no engine {key}: build it (the fleet waits for your offer)",
                "claim": {"since": claim.since, "quiet_s": quiet, "renew_s": round(quiet / 3, 1)},
            }
        when = time.strftime("%H:%M:%SZ", time.gmtime(claim.since))
        return {
            "found": False,
            "build": False,
            "reason": f"engine {key} is being built by {shown(claim.device, 64)} since {when}",
            "building": {
                "device": claim.device,
                "since": claim.since,
                "heard_s": round(time.monotonic() - claim.heard, 1),
            },
            "retry_s": decision.retry_s,
        }

    def claim(self, device: str, claim: EngineClaim) -> dict[str, Any]:
        if claim.action == "renew":
            return {"held": self.claims.renew(claim.key, device, time.monotonic(), self._claim_ended)}
        released = self.claims.release(claim.key, device, claim.reason)
        if released:
            why = shown(claim.reason, 300)
            log.info("fleet.engines.claim_released", device=device, key=claim.key, reason=why)
        return {"released": released}

    def release(self, key: str, reason: str = "") -> dict[str, Any]:
        """The operator's ``fleet engines release KEY``: the claim on ``key`` (or the one key it starts)
        ends; the holder hears so at its next renewal and the next asker builds."""
        if len(key) < 6:
            raise UnknownClaimError(f"key {shown(key, 64)!s}: give at least 6 characters of it")
        found = self.claims.matching(key)
        if not found:
            live = ", ".join(c.key[:12] for c in self.claims.live(time.monotonic())[:5]) or "none"
            raise UnknownClaimError(f"no build claim on key {shown(key, 64)} (claims now: {live})")
        if len(found) > 1:
            keys = ", ".join(c.key[:16] for c in found[:5])
            raise AmbiguousClaimError(
                f"key {shown(key, 64)} starts {len(found)} claims ({keys}): give more of it"
            )
        why = reason.strip()[:200] or "no reason given"
        claim = self.claims.withdraw(found[0].key, why)
        if claim is None:  # ended between the two looks
            raise UnknownClaimError(f"no build claim on key {shown(key, 64)} any more")
        log.warning(
            "fleet.engines.claim_released_by_operator", key=claim.key, device=claim.device, reason=why
        )
        return {
            "released": True,
            "key": claim.key,
            "device": claim.device,
            "job_id": claim.job_id,
            "since": claim.since,
            "waiting": len(claim.waiters),
            "reason": why,
        }

    def live_claims(self, now: float) -> list[Claim]:
        """The claims still running, oldest first, once those whose holder's job is over have ended."""
        self.claims.expire(now, self._claim_ended)
        return self.claims.live(now)

    def _claim_ended(self, claim: Claim) -> str | None:
        """The holder's job ended without ACTIVE, or went ACTIVE ``quiet_s`` ago without offering this
        key (it runs another engine: it will never offer), or None."""
        if claim.job_id is None:
            return None
        facts = self._job_facts(claim.device, claim.job_id)
        if facts is None or facts.state in _STILL_RUNNING:
            return None
        if facts.state != JobState.ACTIVE.value:
            return f"its job {claim.job_id} ended {facts.state}"
        now = time.monotonic()
        if claim.active_seen is None:
            claim.active_seen = now
        upload = self._uploads.get(claim.device)
        if upload is not None and upload.offer.key == claim.key:
            return None  # its offer is coming in
        if now - claim.active_seen <= self.claims.quiet_s:
            return None
        return (
            f"its job {claim.job_id} went ACTIVE {now - claim.active_seen:.0f}s ago and offered no "
            "engine of this key (it runs another one)"
        )

    def offer(self, device: str, offer: EngineOffer) -> dict[str, Any]:
        if self.store.get(offer.key) is not None:
            self.claims.settled(offer.key)
            return {"stored": True, "note": "the fleet holds this engine already"}
        refusal = offer_refusal(
            offer,
            sharing=self.can_vouch,
            job=self._job_facts(device, offer.job_id),
            max_engine_bytes=self.settings.max_engine_bytes,
            withdrawn=self.store.withdrawn(),
        )
        if refusal is not None:
            raise EngineRequestError(f"{refusal.code}: {refusal.reason}")
        want = missing_files(offer, self.store.have_blobs())
        if not want:
            return self._vouch(device, offer)
        self._expire_uploads()
        if device not in self._uploads and len(self._uploads) >= self.settings.max_uploads:
            raise EngineRequestError(f"busy: {len(self._uploads)} uploads in progress; offer again later")
        self._uploads[device] = _Upload(offer, {f.sha256: f.size for f in offer.files if f.sha256 in want})
        return {"stored": False, "want": want}

    def piece(self, device: str, data: bytes, properties: dict[str, str]) -> dict[str, Any]:
        upload = self._uploads.get(device)
        sha = properties.get("sha256", "")
        if upload is None or sha not in upload.wanted:
            raise EngineRequestError("no upload of that file is in progress for this device: offer first")
        if properties.get("size") != str(upload.wanted[sha]):
            raise EngineRequestError(
                f"piece of {sha[:12]}: size {shown(properties.get('size', ''), 20)} is not the offered one"
            )
        upload.touched = time.monotonic()
        return self._sink.take(data, properties)

    def drop(self, device: str, drop: EngineDrop) -> dict[str, Any]:
        stored = self.store.get(drop.key)
        log.warning(
            "fleet.engines.drop_reported",
            device=device,
            key=drop.key,
            stage=drop.stage,
            reason=shown(drop.reason, 300),
        )
        if not withdraws(drop, None if stored is None else stored.record):
            return {"withdrawn": False}
        self.store.withdraw(drop.key, f"{device}: {drop.stage}: {drop.reason}")
        self.store.collect_blobs(self._pending_blobs())
        self.stats["withdrawn"] += 1
        return {"withdrawn": True}

    def _vouch(self, device: str, offer: EngineOffer) -> dict[str, Any]:
        assert self._key is not None
        assert self._key_id
        record = EngineRecord(
            key=offer.key,
            fingerprint=offer.fingerprint,
            meta=offer.meta,
            files=offer.files,
            built_by=device,
            built_at=offer.built_at,
            build_seconds=offer.build_seconds,
            job_id=offer.job_id,
            vouched_at=time.time(),
        )
        signed = sign_record(record, self._key, self._key_id)
        self._uploads.pop(device, None)
        self.store.add(
            signed, record, keep_blobs=self._pending_blobs(), model_id=offer.model_id, version=offer.version
        )
        self.claims.settled(offer.key)
        self.stats["stored"] += 1
        return {"stored": True}

    def _pending_blobs(self) -> set[str]:
        return {sha for upload in self._uploads.values() for sha in upload.wanted}

    def _expire_uploads(self) -> None:
        now = time.monotonic()
        for device in [d for d, u in self._uploads.items() if now - u.touched > UPLOAD_IDLE_S]:
            del self._uploads[device]
            log.info("fleet.engines.upload_abandoned", device=device)

    # -- the operator's view --------------------------------------------------------------------------

    def listing(self) -> dict[str, Any]:
        """``fleet engines list``: per fingerprint, the engines held (most recently used first)."""
        by_platform: dict[str, list[dict[str, Any]]] = {}
        for entry in self.store.entries():
            record = entry.record
            row = EngineListed(
                key=record.key,
                fingerprint=record.fingerprint,
                bytes=entry.bytes,
                built_by=record.built_by,
                built_at=record.built_at,
                build_seconds=record.build_seconds,
                reuse=entry.reuse,
                last_used=entry.last_used,
                model_id=entry.model_id,
                version=entry.version,
                precision=engine_precision(record.meta),
            )
            by_platform.setdefault(record.fingerprint, []).append(row.model_dump(mode="json"))
        now = time.monotonic()
        claims = [
            ClaimListed(
                key=c.key,
                fingerprint=c.fingerprint,
                device=c.device,
                job_id=c.job_id,
                since=c.since,
                heard_s=round(now - c.heard, 1),
                waiting=len(c.waiters),
                model_id=c.model_id,
                version=c.version,
                precision=c.precision,
            ).model_dump(mode="json")
            for c in self.live_claims(now)
        ]
        return {
            "fingerprints": by_platform,
            "claims": claims,
            "engines": sum(len(rows) for rows in by_platform.values()),
            "bytes": self.store.total_bytes(),
            "sharing": self.settings.share and self.can_vouch,
            "signed": self.can_vouch,
        }


def engine_precision(meta: dict[str, Any]) -> str | None:
    """The precision an engine was built at, from its sidecar's identity (None: not there)."""
    identity = meta.get("identity")
    precision = identity.get("precision") if isinstance(identity, dict) else None
    return precision if precision in ("fp32", "fp16", "int8") else None
