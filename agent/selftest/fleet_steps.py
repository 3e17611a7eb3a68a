"""The fleet step: an engine shared through the controller loads and runs on this device.

It takes the TensorRT engine ``build.gpu.fp16`` made, offers it to a real controller engine desk
(its store, trust checks and signing; reached in-process, :mod:`agent.fleet.engines.local`, with a
key made for the run standing in for the operator's), then a second device's builder on a fresh
cache of this same platform asks the fleet, checks the signature and identity, downloads the files
into its cache, and loads the engine with the TensorRT backend: it must run and give the outputs of
the engine it was made from. Skipped where no TensorRT engine was built (this machine: the ONNX
Runtime engines share through the same mechanism and entries, tests/e2e/test_fleet_engines.py).
"""

from __future__ import annotations

import numpy as np

from agent.backends.base import get_backend
from agent.engines.building.artifact import EngineArtifact
from agent.engines.building.builder import EngineBuilder
from agent.engines.sharing.cache import FleetEngineCache
from agent.fleet.controller.upload import UploadSink
from agent.fleet.engines.desk import EngineDesk
from agent.fleet.engines.local import LocalDeskRequests, local_download
from agent.fleet.engines.settings import EngineShareSettings
from agent.fleet.engines.store import EngineStore
from agent.fleet.engines.trust import JobFacts
from agent.measure.throughput import random_feeds
from agent.selftest.engine_steps import build_spec_for, built_engine
from agent.selftest.run import SelfTestRun
from agent.selftest.step import Passed, Skipped, StepFailure
from agent.signing import Ed25519PrivateKey
from agent.specs.build import BuildSpec

_KEY_ID = "selftest"


def downloaded_engine_step(run: SelfTestRun) -> Passed:
    first = built_engine(run, "gpu", "fp16")
    if first.backend != "tensorrt":
        raise Skipped(
            f"the gpu engine here is not a TensorRT engine ({first.backend}): nothing TensorRT to share; "
            "ONNX Runtime engines share through the same entries (tests/e2e/test_fleet_engines.py)"
        )
    return shared_and_loaded(run, first, build_spec_for(run, "gpu", "fp16"))


def shared_and_loaded(run: SelfTestRun, first: EngineArtifact, spec: BuildSpec) -> Passed:
    """Offer ``first`` (built by ``run.builder`` from ``spec``), take it on a second device, load both."""
    key = Ed25519PrivateKey.generate()
    root = run.work_dir / "fleet-step"
    settings = EngineShareSettings()
    store = EngineStore(root / "controller", settings)
    desk = EngineDesk(
        settings,
        store,
        prefix="selftest",
        signing_key=key,
        key_id=_KEY_ID,
        publish=lambda _topic, _payload, _props: None,
        # The self-test stands in for the job: no shadow or probation runs here.
        job_facts=lambda _device, _job: JobFacts("ACTIVE", shadow=True, probation=True),
        sink=UploadSink(store.blobs),
    )
    trusted = {_KEY_ID: key.public_key()}
    builder = run.builder
    offering = FleetEngineCache(
        LocalDeskRequests(desk, "builder"), trusted, local_download(desk), work_dir=root / "builder"
    )
    outcome = offering.offer(builder.cache, first.key, job_id="selftest", shadow=True, probation_s=1.0)
    if outcome != "stored":
        raise StepFailure(f"the controller did not store the offered engine: {outcome}")
    receiver = EngineBuilder(root / "receiver", builder.config, builder.platform)
    receiver.fleet = FleetEngineCache(
        LocalDeskRequests(desk, "receiver"), trusted, local_download(desk), work_dir=root / "receiver-dl"
    )
    with FleetEngineCache.sharing(True, "selftest"):
        second = receiver.build(run.model, spec)
    source = second.effective.get("engine_source", {})
    if source.get("origin") != "downloaded":
        raise StepFailure(f"the second device did not download the engine: {source}")
    difference = _max_difference(first, second)
    data = {"seconds": source.get("seconds"), "key": first.key, "max_abs_diff": difference}
    if difference is None or difference > 0.0:
        raise StepFailure(f"the downloaded engine's outputs differ from its builder's by {difference}", data)
    return Passed(f"downloaded, verified and loaded in {source.get('seconds')} s; same outputs", data)


def _max_difference(first: EngineArtifact, second: EngineArtifact) -> float | None:
    runners = [get_backend(a.backend).load(a.engine_path, a.load_options()) for a in (first, second)]
    try:
        feeds = random_feeds(runners[0].inputs, 1)
        a, b = (runner.infer(feeds) for runner in runners)
        diffs = [float(np.max(np.abs(a[name] - b[name]))) for name in a if name in b]
        return max(diffs) if diffs else None
    finally:
        for runner in runners:
            runner.close()
