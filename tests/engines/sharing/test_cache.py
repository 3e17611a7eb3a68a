"""The engine cache's second level: real builders (two devices' state dirs), a real controller desk
(store, trust checks, the operator's key), real ONNX Runtime engines. The broker and the chunked
pull between them are tests/e2e/test_fleet_engines.py's subject; here the desk is reached in-process
(tests/engines/fleet_desk.py)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnxruntime as ort
import pytest

from agent.datasets.shapes import MODEL_PATH, generate
from agent.demo.modelzoo import write_classifier
from agent.engines.building.artifact import EngineArtifact
from agent.engines.building.builder import EngineBuilder
from agent.engines.service import EngineService
from agent.engines.settings import EngineConfig
from agent.engines.sharing.cache import FLEET_BUILT_BY, FleetEngineCache
from agent.fleet.engines.desk import EngineDesk
from agent.fleet.engines.local import LocalDeskRequests, local_download
from agent.fleet.engines.settings import EngineShareSettings
from agent.fleet.engines.trust import sign_record
from agent.machine.platform import BackendAvailability, Platform
from agent.protocol.engines import EngineAsk
from agent.signing import Ed25519PrivateKey
from agent.specs.build import BuildSpec
from agent.specs.preprocess import PreprocessSpec
from tests.engines.fleet_desk import make_desk
from tests.fleet.engines.records import engine_file, put_blob
from tests.waiting import patient, wait_until

PLATFORM = Platform(
    machine="x86_64",
    onnxruntime_version=ort.__version__,
    ort_providers=("CPUExecutionProvider",),
    backends={
        "onnxruntime": BackendAvailability(True, "onnxruntime"),
        "tensorrt": BackendAvailability(False, "TensorRT is not installed"),
    },
)
SPEC = BuildSpec(precision="fp32", device="cpu")


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_classifier(tmp_path / "classifier.onnx", input_size=32, num_classes=4)


@pytest.fixture
def operator_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


@pytest.fixture
def desk(tmp_path: Path, operator_key: Ed25519PrivateKey) -> EngineDesk:
    return make_desk(tmp_path / "controller" / "engines", operator_key)


def device(tmp_path: Path, name: str, desk: EngineDesk, operator_key: Ed25519PrivateKey) -> EngineBuilder:
    """One device: its own state dir and engine cache, the fleet level trusting the operator's key."""
    builder = EngineBuilder(tmp_path / name, EngineConfig(build_timeout_s=patient(120)), PLATFORM)
    builder.fleet = FleetEngineCache(
        LocalDeskRequests(desk, name),
        {"ops": operator_key.public_key()},
        local_download(desk),
        work_dir=tmp_path / name / "fleet-engines",
        ask_timeout_s=5.0,
    )
    return builder


def built_and_offered(builder: EngineBuilder, model: Path) -> str:
    with FleetEngineCache.sharing(True, "job-1"):
        artifact = builder.build(model, SPEC)
    assert artifact.effective["engine_source"]["origin"] == "built"
    assert builder.fleet is not None
    outcome = builder.fleet.offer(builder.cache, artifact.key, job_id="job-1", shadow=True, probation_s=2.0)
    assert outcome == "stored"
    return artifact.key


def requests_of(builder: EngineBuilder) -> LocalDeskRequests:
    assert builder.fleet is not None
    requests = builder.fleet._requests
    assert isinstance(requests, LocalDeskRequests)
    return requests


def test_a_second_device_downloads_the_engine_the_first_built_and_offered(
    tmp_path: Path, model: Path, desk: EngineDesk, operator_key: Ed25519PrivateKey
) -> None:
    first, second = (device(tmp_path, name, desk, operator_key) for name in ("dev-a", "dev-b"))
    key = built_and_offered(first, model)
    with FleetEngineCache.sharing(True, "job-2"):
        artifact = second.build(model, SPEC)
    source = artifact.effective["engine_source"]
    assert (source["origin"], source["built_by"]) == ("downloaded", "dev-a")
    assert artifact.key == key
    assert artifact.engine_path.read_bytes() == first.cache.get(key).engine_path.read_bytes()  # type: ignore[union-attr]
    entry = second.cache.get(key)
    assert entry is not None
    assert entry.meta.extra[FLEET_BUILT_BY] == "dev-a"
    assert desk.store.entries()[0].reuse == 1
    # A second build on the downloading device is a plain cache hit, and never offered back.
    with FleetEngineCache.sharing(True, "job-3"):
        assert second.build(model, SPEC).effective["engine_source"]["origin"] == "cache"
    assert second.fleet is not None
    assert (
        second.fleet.offer(second.cache, key, job_id="job-2", shadow=True, probation_s=2.0)
        == "not_built_here"
    )


def test_without_the_deployments_permission_a_device_neither_asks_nor_downloads(
    tmp_path: Path, model: Path, desk: EngineDesk, operator_key: Ed25519PrivateKey
) -> None:
    first, second = (device(tmp_path, name, desk, operator_key) for name in ("dev-a", "dev-b"))
    built_and_offered(first, model)
    artifact = second.build(model, SPEC)  # no sharing block: the manifest did not say share_engines
    assert artifact.effective["engine_source"]["origin"] == "built"
    assert requests_of(second).verbs == []


def test_an_engine_that_ran_no_shadow_and_probation_is_not_offered(
    tmp_path: Path, model: Path, desk: EngineDesk, operator_key: Ed25519PrivateKey
) -> None:
    builder = device(tmp_path, "dev-a", desk, operator_key)
    artifact = builder.build(model, SPEC)
    assert builder.fleet is not None
    assert (
        builder.fleet.offer(builder.cache, artifact.key, job_id="j", shadow=False, probation_s=2.0)
        == "not_guarded"
    )
    assert (
        builder.fleet.offer(builder.cache, artifact.key, job_id="j", shadow=True, probation_s=0.0)
        == "not_guarded"
    )
    assert desk.store.entries() == []


def _tamper_record(desk: EngineDesk, key: str, change: dict[str, object]) -> None:
    stored = desk.store.get(key)
    assert stored is not None
    record = json.loads(stored.signed.record)
    record.update(change)
    signed = stored.signed.model_copy(update={"record": json.dumps(record)})
    desk.store._index.engines[key] = stored.model_copy(update={"signed": signed})


def _unsigned(desk: EngineDesk, key: str) -> None:
    stored = desk.store.get(key)
    assert stored is not None
    desk.store._index.engines[key] = stored.model_copy(
        update={"signed": stored.signed.model_copy(update={"signature": ""})}
    )


def _other_key(desk: EngineDesk, key: str) -> None:
    stored = desk.store.get(key)
    assert stored is not None
    signed = sign_record(stored.record, Ed25519PrivateKey.generate(), "ops")
    desk.store._index.engines[key] = stored.model_copy(update={"signed": signed})


def _corrupt_engine_file(desk: EngineDesk, key: str) -> None:
    stored = desk.store.get(key)
    assert stored is not None
    engine = next(f for f in stored.record.files if f.name == stored.record.meta["engine_file"])
    blob = desk.store.blob_path(engine.sha256)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "tamper",
    [
        pytest.param(_unsigned, id="unsigned"),
        pytest.param(
            lambda desk, key: _tamper_record(desk, key, {"built_by": "mallory"}), id="record-altered"
        ),
        pytest.param(_other_key, id="signed-with-another-key"),
        pytest.param(_corrupt_engine_file, id="engine-file-altered"),
    ],
)
def test_a_tampered_or_unsigned_engine_is_refused_and_the_device_builds_here(
    tmp_path: Path, model: Path, desk: EngineDesk, operator_key: Ed25519PrivateKey, tamper: object
) -> None:
    first, second = (device(tmp_path, name, desk, operator_key) for name in ("dev-a", "dev-b"))
    key = built_and_offered(first, model)
    assert callable(tamper)
    tamper(desk, key)
    with FleetEngineCache.sharing(True, "job-2"):
        artifact = second.build(model, SPEC)
    assert artifact.effective["engine_source"]["origin"] == "built"
    assert second.fleet is not None
    assert second.fleet.refused(key) is not None
    entry = second.cache.get(key)
    assert entry is not None
    assert FLEET_BUILT_BY not in entry.meta.extra  # its own build, not the fleet's bytes
    # The controller heard of it (in the background) and withdrew the engine fleet-wide.
    requests = requests_of(second)
    assert requests.heard.wait(patient(10))
    wait_until(lambda: desk.store.get(key) is None, timeout=10, what="the engine withdrawn")
    assert "drop" in requests.verbs


def test_a_fleet_engine_that_fails_to_load_is_dropped_here_and_withdrawn(
    tmp_path: Path, model: Path, desk: EngineDesk, operator_key: Ed25519PrivateKey
) -> None:
    first, second = (device(tmp_path, name, desk, operator_key) for name in ("dev-a", "dev-b"))
    key = built_and_offered(first, model)
    with FleetEngineCache.sharing(True, "job-2"):
        second.build(model, SPEC)
    assert second.fleet is not None
    assert second.fleet.dropped(second.cache, key, "failed validation: outputs are NaN")
    assert second.cache.get(key) is None
    wait_until(lambda: desk.store.get(key) is None, timeout=10, what="the engine withdrawn")
    assert (key, desk.store.withdrawn().pop()[1]) in desk.store.withdrawn()
    # Its own build next: the fleet is not asked for that key again.
    with FleetEngineCache.sharing(True, "job-3"):
        assert second.build(model, SPEC).effective["engine_source"]["origin"] == "built"
    # And the same bad bytes are never taken again, whoever offers them.
    assert first.fleet is not None
    assert first.fleet.offer(first.cache, key, job_id="job-1", shadow=True, probation_s=2.0).startswith(
        "refused: engines: withdrawn"
    )
    # A device's own build is never dropped as a fleet engine.
    assert not first.fleet.dropped(first.cache, key, "x")


def test_an_unsigned_controller_shares_nothing(
    tmp_path: Path, model: Path, operator_key: Ed25519PrivateKey
) -> None:
    desk = make_desk(tmp_path / "controller", None)
    builder = device(tmp_path, "dev-a", desk, operator_key)
    with FleetEngineCache.sharing(True, "job-1"):
        artifact = builder.build(model, SPEC)
    assert builder.fleet is not None
    outcome = builder.fleet.offer(builder.cache, artifact.key, job_id="job-1", shadow=True, probation_s=2.0)
    assert outcome.startswith("refused: engines: sharing_off"), outcome
    assert desk.ask("dev-b", EngineAsk(key=artifact.key)) == {
        "found": False,
        "reason": "this controller has no signing key: it shares no engines",
    }


def _vouch_for_bad_bytes(desk: EngineDesk, key: str, operator_key: Ed25519PrivateKey) -> None:
    """The stored engine replaced by bytes no runtime loads, properly signed: a bad upload vouched for."""
    stored = desk.store.get(key)
    assert stored is not None
    bad = b"not an onnx model" * 64
    put_blob(desk.store.blobs, bad)
    engine = str(stored.record.meta["engine_file"])
    files = [f if f.name != engine else engine_file(f.name, bad) for f in stored.record.files]
    meta = {**stored.record.meta, "engine_sha256": engine_file("x", bad).sha256, "engine_bytes": len(bad)}
    record = stored.record.model_copy(update={"files": files, "meta": meta})
    signed = sign_record(record, operator_key, "ops")
    desk.store._index.engines[key] = stored.model_copy(update={"record": record, "signed": signed})


def test_a_fleet_int8_engine_that_does_not_load_in_the_guard_is_dropped_and_built_here(
    tmp_path: Path, desk: EngineDesk, operator_key: Ed25519PrivateKey
) -> None:
    spec = BuildSpec.model_validate(
        {"precision": "int8", "device": "cpu", "calibration": {"kind": "stream", "frames": 16}}
    )
    preprocess = PreprocessSpec(width=64, height=64)

    def frames(slot: str, n: int) -> list[npt.NDArray[np.uint8]]:
        images, _ = generate(n, seed=7, size=64)
        return list(images)

    config = EngineConfig(int8_agreement=0.5, guard_frames=16, build_timeout_s=patient(120))
    first, second = (
        EngineService(device(tmp_path, name, desk, operator_key), config, frames)
        for name in ("dev-a", "dev-b")
    )
    with FleetEngineCache.sharing(True, "job-1"):
        built = first.prepare("cls", MODEL_PATH, spec, preprocess)
    assert first.builder.fleet is not None
    key = built.artifact.key
    assert (
        first.builder.fleet.offer(first.builder.cache, key, job_id="j", shadow=True, probation_s=2.0)
        == "stored"
    )
    _vouch_for_bad_bytes(desk, key, operator_key)

    with FleetEngineCache.sharing(True, "job-2"):
        prepared = second.prepare("cls", MODEL_PATH, spec, preprocess)
    assert prepared.effective["engine_source"]["origin"] == "built"
    assert "cannot load" in prepared.effective["fleet_engine_failed"]
    assert prepared.effective["int8_guard"]["passed"] is True
    wait_until(lambda: desk.store.get(key) is None, timeout=10, what="the engine withdrawn")


def _build_in_thread(builder: EngineBuilder, model: Path, out: list[object]) -> threading.Thread:
    def run() -> None:
        with FleetEngineCache.sharing(True, "job-2"):
            out.append(builder.build(model, SPEC))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("holder_ends", ["offers", "releases"])
def test_a_device_told_another_builds_the_key_waits_then_downloads_or_takes_the_claim(
    tmp_path: Path, model: Path, operator_key: Ed25519PrivateKey, holder_ends: str
) -> None:
    desk = make_desk(
        tmp_path / "controller" / "engines", operator_key, settings=EngineShareSettings(claim_retry_s=0.1)
    )
    first, second = (device(tmp_path, name, desk, operator_key) for name in ("dev-a", "dev-b"))
    assert first.fleet is not None
    assert second.fleet is not None
    with FleetEngineCache.sharing(True, "job-1"):
        artifact = first.build(model, SPEC)  # told to build: it holds the key's claim
    assert first.fleet.claims.holding(artifact.key)
    built: list[object] = []
    thread = _build_in_thread(second, model, built)
    wait_until(lambda: second.fleet is not None and second.fleet.stats["waited"] == 1, what="dev-b waiting")
    claim = desk.claims.get(artifact.key)
    assert claim is not None
    assert (claim.device, claim.waiters) == ("dev-a", {"dev-b"})
    assert not built  # it waits: its current model keeps serving meanwhile
    if holder_ends == "offers":
        first.fleet.offer(first.cache, artifact.key, job_id="job-1", shadow=True, probation_s=2.0)
    else:
        first.fleet.release(artifact.key, "the job was rolled back")
    thread.join(patient(60))
    (second_artifact,) = built
    assert isinstance(second_artifact, EngineArtifact)
    origin = second_artifact.effective["engine_source"]["origin"]
    assert origin == ("downloaded" if holder_ends == "offers" else "built")
    assert not first.fleet.claims.holding(artifact.key)
    if holder_ends == "releases":
        claim = desk.claims.get(artifact.key)
        assert claim is not None
        assert claim.device == "dev-b"  # the next asker took the claim and built
        assert second.fleet.claims.holding(artifact.key)
    else:
        assert desk.claims.get(artifact.key) is None


def test_a_fleet_int8_engine_below_the_accuracy_bar_here_is_dropped_and_calibrated_here(
    tmp_path: Path, desk: EngineDesk, operator_key: Ed25519PrivateKey
) -> None:
    """dev-a's camera sees black frames: its INT8 engine, calibrated and guarded on them, agrees
    there and is shared. dev-b sees shapes, where that calibration saturates: the guard refuses it,
    dev-b reports the drop (stage ``agreement``), the controller withdraws it, and dev-b serves its
    own INT8 engine calibrated on its own frames (not an FP16 fallback)."""
    spec = BuildSpec.model_validate(
        {"precision": "int8", "device": "cpu", "calibration": {"kind": "stream", "frames": 16}}
    )
    preprocess = PreprocessSpec(width=64, height=64)

    def black(slot: str, n: int) -> list[npt.NDArray[np.uint8]]:
        return list(np.zeros((n, 64, 64, 3), np.uint8))

    def shapes(slot: str, n: int) -> list[npt.NDArray[np.uint8]]:
        images, _ = generate(n, seed=7, size=64)
        return list(images)

    config = EngineConfig(int8_agreement=0.9, guard_frames=32, build_timeout_s=patient(120))
    first = EngineService(device(tmp_path, "dev-a", desk, operator_key), config, black)
    second = EngineService(device(tmp_path, "dev-b", desk, operator_key), config, shapes)
    with FleetEngineCache.sharing(True, "job-1"):
        built = first.prepare("cls", MODEL_PATH, spec, preprocess)
    assert built.effective["int8_guard"]["passed"] is True
    assert first.builder.fleet is not None
    key = built.artifact.key
    offered = first.builder.fleet.offer(first.builder.cache, key, job_id="j", shadow=True, probation_s=2.0)
    assert offered == "stored"

    with FleetEngineCache.sharing(True, "job-2"):
        prepared = second.prepare("cls", MODEL_PATH, spec, preprocess)
    assert "INT8 accuracy guard here" in prepared.effective["fleet_engine_failed"]
    assert prepared.effective["engine_source"]["origin"] == "built"
    assert prepared.effective["int8_guard"]["passed"] is True
    assert prepared.artifact.plan.precision == "int8"
    assert second.builder.fleet is not None
    assert "INT8 accuracy guard here" in (second.builder.fleet.refused(key) or "")
    wait_until(lambda: desk.store.get(key) is None, timeout=10, what="the engine withdrawn")
    assert "drop" in requests_of(second.builder).verbs
