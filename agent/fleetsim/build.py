"""The simulated devices' engine build: a FAKE of the Jetson's TensorRT build, which is absent here.

On a Jetson a YOLO-class FP16 engine takes about five minutes to build (300 s on an Orin NX);
here a build is a sleep of ``--build-seconds`` on the build path (no CPU is spent), after which
a stand-in engine file of a few kilobytes is stored. Everything around the sleep is the agent's own:

* the engine cache key (:func:`agent.engines.cache.key.engine_cache_key` over a real
  :class:`~agent.engines.cache.key.EngineIdentity`: the model's SHA-256, TensorRT and its version,
  the device's GPU, compute capability, L4T release and CUDA, the FP16 GPU plan), so two
  fingerprints (an Orin NX and an AGX Orin, or JetPack 6.0 and 6.1) never share a key;
* the local engine cache (:class:`agent.engines.cache.store.EngineCache`, on disk per device);
* the engine cache's second level at the controller (:class:`agent.engines.sharing.cache.FleetEngineCache`
  over :class:`agent.engines.sharing.link.MqttEngineRequests` and the delivery fetch): on a miss, when
  the manifest shares engines, the device asks the real controller, checks the signed record and
  downloads the files through the chunked MQTT pull; otherwise it "builds", and once the job is
  ACTIVE through shadow and probation it offers the engine (:meth:`SimBuilds.offer_when_active`),
  as :func:`agent.runtime.slots.models.fleet_engines.offer_when_active` does for the real runtime;
  a device told that another device builds the key waits for it (build claims, docs/engines.md);
* at start-up (after an "upgrade"), a model from a sharing deployment asks the fleet the same way
  while its ONNX model serves, and an engine built here is offered after its start-up job
  (:mod:`agent.engines.sharing.startup`) passed its shadow and probation stand-ins.

:class:`BuildCounters` keeps what the benchmark reports per device (builds, build-seconds, downloads,
bytes, asks, uploads); it lives as long as the simulated device's slots (across its restarts).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from agent.delivery.jobs.steps import ActivationRequest, BuildOutcome, FetchFn, JobReporter
from agent.delivery.transfer.engine_fetch import fetch_engine_file
from agent.engines.cache.key import EngineIdentity, engine_cache_key, new_engine_meta
from agent.engines.cache.store import CacheEntry, EngineCache
from agent.engines.sharing.cache import FleetEngineCache, FleetFetch, platform_fingerprint
from agent.engines.sharing.link import MqttEngineRequests
from agent.engines.sharing.startup import startup_job_id
from agent.mqtt.link import MqttLink
from agent.protocol.delivery_errors import JobCancelledError
from agent.protocol.messages import ProbationFigures, ShadowFigures
from agent.protocol.topics import Topics
from agent.signing import Ed25519PublicKey
from agent.specs.build import BuildSpec

#: The stand-in engine's size: a few kilobytes (the transfer is real; its size is not a YOLO's).
ENGINE_BYTES = 4096
_CACHE_BYTES = 64 * 1024 * 1024
#: The start-up build's shadow and probation stand-in (the real agent runs both on live frames).
STARTUP_PROBATION_S = 2.0


@dataclass(frozen=True)
class SimPlatform:
    """The parts of a Jetson's platform an engine depends on (what the engine cache key takes)."""

    device_model: str
    gpu_name: str
    compute_capability: str
    l4t_release: str
    jetpack: str
    tensorrt_version: str
    cuda_version: str
    dla_cores: int


_BOARDS = {
    # hw label suffix -> (device model, GPU name as the key takes it, DLA cores)
    "nano": ("NVIDIA Jetson Orin Nano", "Orin Nano", 0),
    "agx": ("NVIDIA Jetson AGX Orin", "AGX Orin", 2),
    "nx": ("NVIDIA Jetson Orin NX", "Orin NX", 2),
}
#: JetPack 6.0, and the "upgrade" (JetPack 6.1: new L4T, TensorRT and CUDA: every engine key changes).
_RELEASES = (("R36.3.0", "6.0", "8.6.2", "12.2"), ("R36.4.0", "6.1", "10.3.0", "12.6"))


def sim_platform(labels: Mapping[str, str], *, upgraded: bool = False) -> SimPlatform:
    """The simulated device's platform: the board from its ``hw`` label (``orin-nano``, ``orin-agx``,
    else an Orin NX), the release JetPack 6.0, or 6.1 once ``upgraded``."""
    hw = labels.get("hw", "")
    board = next((b for suffix, b in _BOARDS.items() if hw.endswith(suffix)), _BOARDS["nx"])
    l4t, jetpack, trt, cuda = _RELEASES[1 if upgraded else 0]
    return SimPlatform(board[0], board[1], "8.7", l4t, jetpack, trt, cuda, board[2])


def engine_identity(platform: SimPlatform, model_sha256: str) -> EngineIdentity:
    """The engine identity of a YOLO-class FP16 GPU build of the model on ``platform``."""
    return EngineIdentity(
        model_sha256=model_sha256,
        backend="tensorrt",
        backend_version=platform.tensorrt_version,
        precision="fp16",
        device="gpu",
        gpu_name=platform.gpu_name,
        compute_capability=platform.compute_capability,
        l4t_release=platform.l4t_release,
        cuda_version=platform.cuda_version,
        machine="aarch64",
    )


def _engine_bytes(key: str) -> bytes:
    """The stand-in engine: a few kilobytes derived from its key."""
    return (hashlib.sha256(key.encode()).digest() * (ENGINE_BYTES // 32))[:ENGINE_BYTES]


class BuildCounters:
    """One simulated device's engine figures, summed over its restarts (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values: dict[str, float] = {
            "builds": 0,
            "build_s": 0.0,
            "downloads": 0,
            "download_s": 0.0,
            "download_bytes": 0,
            "cache_hits": 0,
            "asked": 0,
            "waited": 0,
            "offered": 0,
            "uploaded": 0,
        }
        #: Per fingerprint: builds here, downloads (``{fingerprint: {"builds": n, "downloads": n}}``).
        self.by_fingerprint: dict[str, dict[str, int]] = {}
        #: When this device last served a model it had to build or download for (Unix time).
        self.engine_ready_at: float | None = None

    def add(self, name: str, value: float, fingerprint: str | None = None) -> None:
        with self._lock:
            self.values[name] += value
            if fingerprint is not None:
                row = self.by_fingerprint.setdefault(fingerprint, {"builds": 0, "downloads": 0})
                row[name] = row.get(name, 0) + int(value)

    def ready(self) -> None:
        with self._lock:
            self.engine_ready_at = time.time()

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                **{k: round(v, 3) if isinstance(v, float) else v for k, v in self.values.items()},
                "by_fingerprint": {fp: dict(row) for fp, row in self.by_fingerprint.items()},
                "engine_ready_at": self.engine_ready_at,
            }


class SimBuilds:
    """One device's builds: the delivery service's ``build`` and the offer after ACTIVE (see the module
    docstring). ``build_seconds`` is the fake build's length."""

    def __init__(
        self,
        *,
        root: Path,
        link: MqttLink,
        topics: Topics,
        trusted: Mapping[str, Ed25519PublicKey],
        fetch: FetchFn,
        platform: SimPlatform,
        build_seconds: float,
        counters: BuildCounters,
    ) -> None:
        self.platform = platform
        self.build_seconds = build_seconds
        self.counters = counters
        self.cache = EngineCache(root / "engines", _CACHE_BYTES)
        self.fleet = FleetEngineCache(
            MqttEngineRequests(link, topics),
            trusted,
            partial(fetch_engine_file, fetch=fetch),
            work_dir=root / "fleet-engines",
        )
        self._lock = threading.Lock()
        #: Slots serving their ONNX model while their engine builds at start-up (slot -> identity).
        self.interim: dict[str, EngineIdentity] = {}

    def identity(self, model_sha256: str) -> EngineIdentity:
        return engine_identity(self.platform, model_sha256)

    def build(self, model: Path, spec: BuildSpec | None, reporter: JobReporter) -> BuildOutcome:
        """The delivery service's BUILDING step: the local cache, the fleet, else the fake build."""
        del spec  # every simulated build is the same FP16 GPU plan
        sha = model.stem if len(model.stem) == 64 else hashlib.sha256(model.read_bytes()).hexdigest()
        identity = self.identity(sha)
        key = engine_cache_key(identity)
        fingerprint = platform_fingerprint(identity)
        origin = "cache"
        seconds = 0.0
        entry = self.cache.get(key)
        if entry is None:
            with FleetEngineCache.sharing(reporter.share_engines, reporter.job_id):
                fetched = self._fetch(key, identity, reporter.cancel)
            if fetched is not None:
                entry, origin, seconds = fetched.entry, "downloaded", fetched.seconds
                self.counters.add("downloads", 1, fingerprint)
                self.counters.add("download_s", fetched.seconds)
                self.counters.add("download_bytes", fetched.bytes)
            else:
                entry, seconds = self._fake_build(key, identity, reporter), self.build_seconds
                origin = "built"
                self.counters.add("builds", 1, fingerprint)
                self.counters.add("build_s", self.build_seconds)
        else:
            self.counters.add("cache_hits", 1)
        reporter.progress(1.0)
        return BuildOutcome(
            engine_path=entry.engine_path,
            backend="tensorrt",
            effective={
                "backend": "tensorrt",
                "precision": "fp16",
                "device": "gpu",
                "engine_source": {"origin": origin, "seconds": round(seconds, 3), "key": key[:12]},
                "simulated_build": True,
            },
        )

    def _fetch(self, key: str, identity: EngineIdentity, cancel: threading.Event) -> FleetFetch | None:
        """The fleet's engine (the agent's own second level), counting asks and waits."""
        before = dict(self.fleet.stats)
        fetched = self.fleet.fetch(self.cache, key, identity, lambda _m: None, cancel)
        for name in ("asked", "waited"):
            self.counters.add(name, self.fleet.stats[name] - before[name])
        return fetched

    def _fake_build(self, key: str, identity: EngineIdentity, reporter: JobReporter) -> CacheEntry:
        """The FAKE: wait ``build_seconds`` (cancellable), then store a few kilobytes as the engine."""
        if reporter.cancel.wait(self.build_seconds):
            self.fleet.release(key, "the build was cancelled")
            raise JobCancelledError(f"simulated engine build {key[:12]} cancelled")
        meta = new_engine_meta(identity, build_seconds=self.build_seconds)
        return self.cache.put(key, _engine_bytes(key), meta)

    def offer_when_active(self, request: ActivationRequest, *, guarded: bool) -> None:
        """The job's engine went ACTIVE: offered as the real runtime offers it (shared, guarded by
        shadow and probation, built here; :meth:`FleetEngineCache.offer` refuses a fleet engine)."""
        if request.engine_path.parent.parent != self.cache.root:
            return
        if not request.share_engines or not guarded:
            self.fleet.release(request.engine_path.parent.name, "its job ran no shadow and probation")
            return
        job_id = request.guard.job_id if request.guard is not None else request.version
        before = dict(self.fleet.stats)
        thread = self.fleet.offer_in_background(
            self.cache,
            request.engine_path.parent.name,
            job_id=job_id or request.version,
            shadow=request.shadow is not None,
            probation_s=request.probation_s,
        )
        if thread is not None:
            threading.Thread(target=self._count_offer, args=(thread, before), daemon=True).start()

    def _count_offer(self, thread: threading.Thread, before: dict[str, int]) -> None:
        thread.join()
        for name in ("offered", "uploaded"):
            self.counters.add(name, self.fleet.stats[name] - before[name])

    # -- start-up: serve while building ----------------------------------------------------------------

    def seed(self, model_sha256: str) -> None:
        """The device was provisioned with this model's engine (uncounted): no build at its first start."""
        identity = self.identity(model_sha256)
        key = engine_cache_key(identity)
        if self.cache.get(key) is None:
            self.cache.put(key, _engine_bytes(key), new_engine_meta(identity, build_seconds=0.0))

    def start_up(
        self,
        models: Mapping[str, str],
        stop: threading.Event,
        on_ready: Callable[[], None] | None = None,
        *,
        share: bool = False,
    ) -> None:
        """The slots' models at start: an engine missing from the cache (after an "upgrade" changed the
        key) is made on a thread while the slot serves its ONNX model, as the real agent's
        ``serve_while_building`` does. With ``share`` (the model came from a deployment that shared
        engines), as the real agent: the fleet is asked first (download; or wait while another device
        of the fingerprint builds; or build under the claim), and an engine built here is offered once
        its start-up job passed the shadow and probation stand-ins (:data:`STARTUP_PROBATION_S`)."""
        missing = {}
        for slot, sha in models.items():
            identity = self.identity(sha)
            if self.cache.get(engine_cache_key(identity)) is None:
                missing[slot] = identity
        if not missing:
            return
        with self._lock:
            self.interim.update(missing)
        threading.Thread(
            target=self._build_at_start, args=(missing, stop, on_ready, share), daemon=True
        ).start()

    def _build_at_start(
        self,
        missing: Mapping[str, EngineIdentity],
        stop: threading.Event,
        on_ready: Callable[[], None] | None,
        share: bool,
    ) -> None:
        for slot, identity in missing.items():
            key = engine_cache_key(identity)
            fingerprint = platform_fingerprint(identity)
            job_id = startup_job_id(slot)
            with FleetEngineCache.sharing(share, job_id):
                fetched = self._fetch(key, identity, stop)
            if stop.is_set():
                return  # the device stopped: the next start asks, or builds, again
            if fetched is not None:
                self.counters.add("downloads", 1, fingerprint)
                self.counters.add("download_s", fetched.seconds)
                self.counters.add("download_bytes", fetched.bytes)
            else:
                if stop.wait(self.build_seconds):
                    return  # killed mid-build: its claim goes quiet and the controller lets it go
                self.cache.put(
                    key, _engine_bytes(key), new_engine_meta(identity, build_seconds=self.build_seconds)
                )
                self.counters.add("builds", 1, fingerprint)
                self.counters.add("build_s", self.build_seconds)
            with self._lock:
                self.interim.pop(slot, None)
            self.counters.ready()
            if on_ready is not None:
                on_ready()  # up/info: the slot serves its engine now
            if fetched is None and share:
                self._offer_after_startup_guard(slot, key, job_id, stop)

    def _offer_after_startup_guard(self, slot: str, key: str, job_id: str, stop: threading.Event) -> None:
        """The stand-in of the real start-up swap's shadow (against the ONNX model) and probation, then
        the start-up job's ACTIVE status (the controller's evidence) and the offer."""
        if stop.wait(STARTUP_PROBATION_S):
            return
        shadow = ShadowFigures(frames=32, agreement=0.99, latency_ratio=0.4, bad_outputs=0)
        probation = ProbationFigures(elapsed_s=STARTUP_PROBATION_S, probation_s=STARTUP_PROBATION_S)
        before = dict(self.fleet.stats)
        self.fleet.offer_after_startup(
            self.cache, key, job_id=job_id, slot=slot, shadow=shadow, probation=probation
        ).join()
        for name in ("offered", "uploaded"):
            self.counters.add(name, self.fleet.stats[name] - before[name])

    def serving(self, slot: str) -> str:
        """``interim`` while the slot's engine builds at start (its ONNX model serves), else ``engine``."""
        with self._lock:
            return "interim" if slot in self.interim else "engine"
