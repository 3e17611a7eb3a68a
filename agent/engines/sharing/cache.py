"""The engine cache's second level, at the fleet controller (docs/engines.md, "Engines for the whole fleet").

On a local miss the builder asks :meth:`FleetEngineCache.fetch`: when the deployment lets it (the
manifest's ``share_engines``) it asks the controller for the same cache key, waits a bounded time,
and when the controller holds the engine it checks the signed record (:mod:`agent.engines.sharing.trust`),
downloads every file through the same chunked MQTT pull / HTTP path as models (each file checked
against its signed SHA-256) and stores the entry in the local cache, marked as the fleet's. Anything
wrong (no answer, no engine, a refused signature or identity, a failed download) is a miss: the
device builds, as it always did. Before asking, it looks for the key among the engines an offline
bundle carried (:mod:`agent.engines.sharing.imported`), taken through the same checks.

One build per key for the whole fleet: when the controller holds no engine, the first asker is told
to build it and holds the key's *claim* (:mod:`agent.engines.sharing.claims` renews it while the build,
shadow and probation run, and releases it when they end without an offer); every other asker is
told who builds it and waits, asking again at the pace the controller says (bounded by
``wait_max_s`` in all; its current model, or at start-up its ONNX model, serves meanwhile), and
downloads the engine once it is stored, or takes the claim when the builder gave up.

After a job runs an engine this device *built* to ACTIVE through shadow and probation, the runtime
calls :meth:`offer`: the entry's files go to the controller in pieces (the upload path of
``fleet rollout start``), in the background. A fleet engine that fails to load or validate here is
:meth:`dropped`: removed from the local cache, never asked for again by this agent process, and
reported to the controller, which withdraws it fleet-wide.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from agent.engines.cache.key import EngineIdentity
from agent.engines.cache.store import CacheEntry, EngineCache
from agent.engines.sharing.claims import HeldClaims
from agent.engines.sharing.imported import ImportedEngines
from agent.engines.sharing.link import EngineRequests
from agent.engines.sharing.startup import startup_active_status
from agent.engines.sharing.trust import EngineRefusedError, checked_meta, verified_record
from agent.engines.sharing.upload import describe_entry, offer_and_upload
from agent.errors import AgentError
from agent.protocol.engines import (
    MAX_MODEL_TEXT,
    DropStage,
    EngineAsk,
    EngineDrop,
    EngineFile,
    EngineOffer,
    SignedEngine,
)
from agent.protocol.messages import ProbationFigures, ShadowFigures
from agent.signing import Ed25519PublicKey

log = structlog.get_logger(__name__)

#: ``download(file, directory, cancel) -> path``: the file pulled into ``directory`` and checked
#: against ``file.sha256`` (raises on failure). Wired to the delivery fetch by the composition root.
DownloadFn = Callable[[EngineFile, Path, threading.Event | None], Path]
Progress = Callable[[str], None]


#: ``meta.extra`` keys of an entry that came from the fleet (never offered back).
FLEET_BUILT_BY = "fleet_built_by"
FLEET_JOB = "fleet_job"
#: How the progress line of a fleet ask starts (a slot serving while it builds starts serving then).
ASKING_THE_FLEET = "asking the fleet"
#: Keys this agent refuses to take from the fleet again (a dropped or refused engine), kept bounded.
_REFUSED_KEPT = 256
#: Asks left unanswered (each waits ``ask_timeout_s``) before the device builds without the fleet.
_UNANSWERED_TRIES = 6
#: Bounds on the wait between two asks the controller suggests to a waiting device.
_MIN_RETRY_S = 0.5
_MAX_RETRY_S = 60.0


@dataclass(frozen=True)
class Sharing:
    """What the running deployment allows: take engines from the fleet, for which job."""

    job_id: str | None
    #: The model and version the deployment delivers (the controller shows them per key).
    model_id: str | None = None
    version: str | None = None


#: The deployment a build runs for, when its manifest says ``share_engines`` (None: no sharing).
_SHARING: ContextVar[Sharing | None] = ContextVar("engine_sharing", default=None)


@dataclass(frozen=True)
class FleetFetch:
    """An engine downloaded from the fleet: its new local entry, who built it, how long it took."""

    entry: CacheEntry
    built_by: str
    seconds: float
    bytes: int


class FleetEngineCache:
    """Ask, download, offer and drop fleet-shared engines for one device (see the module docstring)."""

    def __init__(
        self,
        requests: EngineRequests,
        trusted: Mapping[str, Ed25519PublicKey],
        download: DownloadFn,
        *,
        work_dir: Path,
        ask_timeout_s: float = 10.0,
        reply_timeout_s: float = 30.0,
        wait_max_s: float = 1200.0,
        claim_hold_max_s: float = 7200.0,
        imported: ImportedEngines | None = None,
    ) -> None:
        self._requests = requests
        self._imported = imported
        self._trusted = dict(trusted)
        self._download = download
        self._work_dir = Path(work_dir)
        self.ask_timeout_s = ask_timeout_s
        self.reply_timeout_s = reply_timeout_s
        self.wait_max_s = wait_max_s
        self.claims = HeldClaims(requests, reply_timeout_s=reply_timeout_s, hold_max_s=claim_hold_max_s)
        self._lock = threading.Lock()
        self._refused: OrderedDict[str, str] = OrderedDict()
        self._offering = threading.Lock()  # one upload at a time
        self.stats: dict[str, int] = {
            "asked": 0,
            "downloaded": 0,
            "refused": 0,
            "offered": 0,
            "uploaded": 0,
            "dropped": 0,
            "waited": 0,
            "claimed": 0,
        }

    def _count(self, name: str) -> None:
        with self._lock:  # asks, offers and drops run on different threads
            self.stats[name] += 1

    # -- the deployment's permission ---------------------------------------------------------------

    @staticmethod
    @contextlib.contextmanager
    def sharing(
        enabled: bool, job_id: str | None, model_id: str | None = None, version: str | None = None
    ) -> Iterator[None]:
        """Builds inside this block may take their engine from the fleet (when ``enabled``), for job
        ``job_id`` of ``model_id`` at ``version``."""
        token = _SHARING.set(Sharing(job_id, model_id, version) if enabled else None)
        try:
            yield
        finally:
            _SHARING.reset(token)

    def refused(self, key: str) -> str | None:
        """Why this agent no longer takes ``key`` from the fleet (None: it does)."""
        with self._lock:
            return self._refused.get(key)

    def _refuse(self, key: str, reason: str) -> None:
        with self._lock:
            self._refused[key] = reason
            self._refused.move_to_end(key)
            while len(self._refused) > _REFUSED_KEPT:
                self._refused.popitem(last=False)

    # -- level two: ask and download ---------------------------------------------------------------

    def fetch(
        self,
        cache: EngineCache,
        key: str,
        identity: EngineIdentity,
        say: Progress,
        cancel: threading.Event | None = None,
    ) -> FleetFetch | None:
        """The fleet's engine for ``key`` stored in ``cache``, or None (build it here). Never raises
        for the fleet's answers: every refusal is said, logged and counted."""
        sharing = _SHARING.get()
        if sharing is None or self.refused(key) is not None:
            return None
        carried = self._from_import(cache, key, identity, say, cancel)
        if carried is not None or self.refused(key) is not None:
            return carried
        started = time.monotonic()
        self._count("asked")
        say(f"{ASKING_THE_FLEET} for engine {key[:12]}")
        ask = EngineAsk(
            key=key,
            job_id=sharing.job_id,
            fingerprint=platform_fingerprint(identity),
            model_id=bounded_name(sharing.model_id),
            version=bounded_name(sharing.version),
            precision=identity.precision,
        )
        result = self._ask_until_found(ask, started, say, cancel)
        if result is None:
            return None
        return self._take(
            cache,
            key,
            identity,
            result.get("engine"),
            download=self._download,
            say=say,
            cancel=cancel,
            started=started,
        )

    def _from_import(
        self,
        cache: EngineCache,
        key: str,
        identity: EngineIdentity,
        say: Progress,
        cancel: threading.Event | None,
    ) -> FleetFetch | None:
        """The engine an offline bundle carried for ``key`` (:mod:`.imported`), checked as one from the
        fleet; None when none was imported."""
        signed = self._imported.signed(key) if self._imported is not None else None
        if signed is None or self._imported is None:
            return None
        started = time.monotonic()
        return self._take(
            cache,
            key,
            identity,
            signed,
            download=self._imported.copy,
            say=say,
            cancel=cancel,
            started=started,
            imported=True,
        )

    def _take(
        self,
        cache: EngineCache,
        key: str,
        identity: EngineIdentity,
        engine: object,
        *,
        download: DownloadFn,
        say: Progress,
        cancel: threading.Event | None,
        started: float,
        imported: bool = False,
    ) -> FleetFetch | None:
        """The fleet's signed ``engine`` checked (:mod:`.trust`) and its files fetched with ``download``
        into ``cache``; None (build here) when anything is refused."""
        where = "imported" if imported else "fleet"
        try:
            signed = SignedEngine.model_validate(engine)
            record = verified_record(signed, self._trusted)
            meta = checked_meta(record, key, identity)
            entry = self._download_entry(
                cache,
                key,
                record.files,
                meta.model_copy(
                    update={
                        "extra": {**meta.extra, FLEET_BUILT_BY: record.built_by, FLEET_JOB: record.job_id}
                    }
                ),
                cancel,
                download=download,
            )
        except (EngineRefusedError, AgentError, OSError, ValueError) as exc:
            self._count("refused")
            reason = str(exc)[:300]
            log.warning(f"engine.{where}.refused", key=key, reason=reason)
            say(f"{where} engine {key[:12]} refused: {reason}; building here")
            self._refuse(key, reason)
            if not imported:  # a damaged stick says nothing about the engine the controller holds
                self._report_drop(key, None, "verify", reason)
            return None
        seconds = time.monotonic() - started
        size = sum(f.size for f in record.files)
        self._count("downloaded")
        log.info(f"engine.{where}.downloaded", key=key, built_by=record.built_by, seconds=round(seconds, 3))
        source = "an imported bundle" if imported else "the fleet"
        say(f"downloaded engine {key[:12]} from {source} (built by {record.built_by}) in {seconds:.1f}s")
        return FleetFetch(entry, record.built_by, seconds, size)

    def _ask_until_found(
        self, ask: EngineAsk, started: float, say: Progress, cancel: threading.Event | None
    ) -> dict[str, Any] | None:
        """The controller's ``found`` answer, or None (build here: told to, no answer, waited too long)."""
        key, waited, unanswered = ask.key[:12], False, 0
        while True:
            reply = self._requests.request("ask", ask, self.ask_timeout_s)
            if reply is None:
                # Asked again a few times: a device (re)starting with its fleet asks before its link is
                # up, or into a controller flooded by the whole fleet coming back after an upgrade.
                unanswered += 1
                if unanswered >= _UNANSWERED_TRIES or time.monotonic() - started >= self.wait_max_s:
                    say(f"no answer to {unanswered} asks ({self.ask_timeout_s:.0f}s each): building here")
                    return None
                # A pause of 0.5 to 3 s, so a fleet restarting together does not ask again in step.
                if (cancel or threading.Event()).wait(random.uniform(0.5, 3.0)):
                    return None
                continue
            result = reply.result or {}
            if reply.ok and result.get("found"):
                return result
            why = str(reply.error or result.get("reason") or "the fleet holds no such engine")[:200]
            # An older controller says only "not here" (no "build"): build, as then.
            if not reply.ok or result.get("build", True):
                if reply.ok and isinstance(result.get("claim"), dict):
                    self._count("claimed")
                    self.claims.hold(ask.key, result["claim"], ask.job_id)
                say(f"fleet: {why}; building here")
                return None
            spent = time.monotonic() - started
            left = self.wait_max_s - spent
            if left <= 0:
                say(f"fleet: {why}; waited {spent:.0f}s (engines.fleet_wait_max_s): building here")
                return None
            if not waited:
                waited = True
                self._count("waited")
            say(f"fleet: {why}; waiting for its engine {key} ({spent:.0f}s of {self.wait_max_s:.0f}s)")
            retry = float(result.get("retry_s") or 5.0)
            retry = min(max(retry, _MIN_RETRY_S), _MAX_RETRY_S) * random.uniform(0.8, 1.2)
            if (cancel or threading.Event()).wait(min(retry, left)):
                return None  # the job was cancelled: the build step ends it

    def release(self, key: str, reason: str) -> None:
        """This device gave up building ``key`` without an engine to offer: the next asker builds it."""
        self.claims.release(key, reason)

    def release_job(self, job_id: str, reason: str, *, keep: Collection[str] = ()) -> list[str]:
        """Job ``job_id`` will offer nothing more: every claim it still holds but ``keep``'s ends."""
        return self.claims.release_job(job_id, reason, keep=keep)

    def _download_entry(
        self,
        cache: EngineCache,
        key: str,
        files: list[EngineFile],
        meta: Any,
        cancel: threading.Event | None,
        *,
        download: DownloadFn,
    ) -> CacheEntry:
        staging = self._work_dir / f"{key[:16]}-{uuid.uuid4().hex[:8]}"
        staging.mkdir(parents=True, exist_ok=True)
        try:
            paths: dict[str, Path] = {}
            for file in files:
                part_dir = staging / f"part-{file.sha256[:16]}"
                part_dir.mkdir()
                paths[file.name] = download(file, part_dir, cancel)
            engine = paths.pop(meta.engine_file)
            return cache.put(key, engine, meta, files=paths, move=True)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    # -- offering what this device built -------------------------------------------------------------

    def offer_in_background(
        self,
        cache: EngineCache,
        key: str,
        *,
        job_id: str,
        shadow: bool,
        probation_s: float,
        model: tuple[str | None, str | None] = (None, None),
    ) -> threading.Thread | None:
        """:meth:`offer` on a thread of its own (the job that went ACTIVE does not wait for the upload)."""
        if not shadow or probation_s <= 0:
            log.info("engine.fleet.not_offered", key=key, reason="the job ran no shadow and probation")
            self.release(key, "its job ran no shadow and probation: nothing to offer")
            return None
        thread = threading.Thread(
            target=self.offer,
            args=(cache, key),
            kwargs={"job_id": job_id, "shadow": shadow, "probation_s": probation_s, "model": model},
            name=f"engine-offer-{key[:8]}",
            daemon=True,
        )
        thread.start()
        return thread

    def offer_after_startup(
        self,
        cache: EngineCache,
        key: str,
        *,
        job_id: str,
        slot: str,
        shadow: ShadowFigures,
        probation: ProbationFigures,
        model: tuple[str | None, str | None] = (None, None),
    ) -> threading.Thread:
        """A start-up build's engine swapped in through shadow and probation (:mod:`.startup`):
        its start-up job's ACTIVE status (the controller's evidence) goes out, then the offer, in the
        background."""
        self._requests.job_status(startup_active_status(job_id, slot, shadow, probation))

        def run() -> None:
            self.offer(cache, key, job_id=job_id, shadow=True, probation_s=probation.probation_s, model=model)

        thread = threading.Thread(target=run, name=f"engine-offer-{key[:8]}", daemon=True)
        thread.start()
        return thread

    def offer(
        self,
        cache: EngineCache,
        key: str,
        *,
        job_id: str,
        shadow: bool,
        probation_s: float,
        model: tuple[str | None, str | None] = (None, None),
    ) -> str:
        """Offer the entry ``key`` (built here, ACTIVE through shadow and probation, for ``model``: its
        id and version) to the controller and upload what it wants; returns what happened (``stored``,
        ``not_built_here``, a refusal ...)."""
        outcome = self._offer(cache, key, job_id=job_id, shadow=shadow, probation_s=probation_s, model=model)
        if outcome == "stored":
            self.claims.settled(key)  # the controller ended the claim as it stored the engine
        else:
            self.release(key, f"offer: {outcome}")
        return outcome

    def _offer(
        self,
        cache: EngineCache,
        key: str,
        *,
        job_id: str,
        shadow: bool,
        probation_s: float,
        model: tuple[str | None, str | None],
    ) -> str:
        if not shadow or probation_s <= 0:
            return "not_guarded"  # trust rule: only engines that ran through shadow and probation
        with self._offering:
            entry = cache.get(key)
            if entry is None:
                return "not_cached"
            if FLEET_BUILT_BY in entry.meta.extra:
                return "not_built_here"  # the fleet has it already (it came from there)
            files = describe_entry(entry)
            if files is None:
                log.info("engine.fleet.not_offered", key=key, reason="the entry holds a directory")
                return "not_shareable"
            offer = EngineOffer(
                key=key,
                fingerprint=platform_fingerprint(entry.meta.identity),
                meta=entry.meta.model_dump(mode="json"),
                files=files,
                built_at=entry.meta.created_at,
                build_seconds=entry.meta.build_seconds,
                job_id=job_id,
                model_id=bounded_name(model[0]),
                version=bounded_name(model[1]),
                shadow=shadow,
                probation_s=probation_s,
            )
            self._count("offered")
            outcome = offer_and_upload(self._requests, entry, offer, self.reply_timeout_s)
            if outcome == "stored":
                self._count("uploaded")
            log.info("engine.fleet.offered", key=key, outcome=outcome)
            return outcome

    # -- a fleet engine that failed here -------------------------------------------------------------

    def dropped(self, cache: EngineCache, key: str, reason: str, stage: DropStage = "load") -> bool:
        """A fleet engine failed to load or validate (``load``) or to agree with the model on this
        device's frames (``agreement``): drop it, never take it again, tell the controller (which
        withdraws it). False when ``key`` was not a fleet engine (nothing done)."""
        entry = cache.get(key)
        if entry is None or FLEET_BUILT_BY not in entry.meta.extra:
            return False
        self._count("dropped")
        self.release(key, f"dropped: {reason}")
        cache.remove(key)
        self._refuse(key, reason)
        log.warning("engine.fleet.dropped", key=key, reason=reason[:300])
        self._report_drop(key, entry.meta.engine_sha256, stage, reason)
        return True

    def _report_drop(self, key: str, engine_sha256: str | None, stage: DropStage, reason: str) -> None:
        drop = EngineDrop.model_validate(
            {"key": key, "engine_sha256": engine_sha256, "stage": stage, "reason": reason[:300]}
        )
        # Told in the background: the device builds at once, whether or not the controller hears it.
        threading.Thread(
            target=self._requests.request,
            args=("drop", drop, self.reply_timeout_s),
            name=f"engine-drop-{key[:8]}",
            daemon=True,
        ).start()


def platform_fingerprint(identity: EngineIdentity) -> str:
    """The platform an engine is for, as ``fleet engines list`` groups it: backend and its exact
    version, the device (GPU and compute capability, or the machine) and the L4T release."""
    device = " ".join(p for p in (identity.gpu_name, identity.compute_capability) if p) or identity.machine
    parts = [f"{identity.backend} {identity.backend_version}", device or "unknown device", identity.device]
    if identity.l4t_release:
        parts.append(f"L4T {identity.l4t_release}")
    return " / ".join(parts)[:300]


def bounded_name(text: str | None) -> str | None:
    """A model id or version as an engine request carries it (cut to the protocol's bound)."""
    return None if text is None else text[:MAX_MODEL_TEXT]
