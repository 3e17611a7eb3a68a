"""EngineBuilder: plan, key, cache, worker, with real ONNX models and real build children.

TensorRT is absent here, so every plan goes to ONNX Runtime on the CPU.
"""

from __future__ import annotations

import threading
from pathlib import Path

import cv2
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from agent.backends.base import get_backend
from agent.demo.modelzoo import write_classifier
from agent.engines.building.builder import EngineBuilder
from agent.engines.building.worker import BuildWorker
from agent.engines.cache.key import SIDECAR_NAME
from agent.engines.calibration.data import calibration_identity
from agent.engines.calibration.int8 import host_cpu_flags, reduce_range_for
from agent.engines.job import BuildJob, Progress, WorkerResult
from agent.engines.settings import EngineConfig
from agent.errors import BuildError
from agent.machine.platform import BackendAvailability, Platform
from agent.model_contract.model_facts import model_facts
from agent.specs.build import BuildSpec, CalibrationSource
from agent.specs.preprocess import PreprocessSpec
from tests.engines.failing_jobs import TEST_ENV
from tests.waiting import patient

PLATFORM = Platform(
    machine="x86_64",
    onnxruntime_version=ort.__version__,
    ort_providers=("CPUExecutionProvider",),
    backends={
        "onnxruntime": BackendAvailability(True, "onnxruntime"),
        "tensorrt": BackendAvailability(False, "TensorRT is not installed"),
    },
)


class CrashingWorker(BuildWorker):
    """Runs every job as the test-only 'crash' kind: a real child that segfaults."""

    def run(
        self, job: BuildJob, progress: Progress | None = None, cancel: threading.Event | None = None
    ) -> WorkerResult:
        return super().run(job.model_copy(update={"kind": "crash"}), progress, cancel)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_classifier(tmp_path / "classifier.onnx", input_size=32, num_classes=4)


@pytest.fixture
def builder(tmp_path: Path) -> EngineBuilder:
    return EngineBuilder(tmp_path / "state", EngineConfig(build_timeout_s=patient(120)), PLATFORM)


def frames(seed: int, n: int = 4) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.random((4, 3, 32, 32), dtype=np.float32) for _ in range(n)]


def run(artifact_path: Path, options: object, batch: int = 2) -> np.ndarray:
    from agent.backends.base import LoadOptions

    assert isinstance(options, LoadOptions)
    runner = get_backend("onnxruntime").load(artifact_path, options)
    try:
        out = runner.infer({"images": np.ones((batch, 3, 32, 32), np.float32)})
    finally:
        runner.close()
    return out["scores"]


def test_cold_build_then_cache_hit_without_a_worker(builder: EngineBuilder, model: Path) -> None:
    spec = BuildSpec(precision="fp16", device="auto")
    progress: list[str] = []
    cold = builder.build(model, spec, progress=progress.append)
    assert not cold.cache_hit
    assert builder.worker.launches == 1
    assert cold.backend == "onnxruntime"
    assert cold.engine_path.is_file()
    assert cold.engine_path.parent.name == cold.key
    assert any("cache miss" in line for line in progress)
    # Requested vs effective, every change with a reason.
    assert cold.effective["requested"] == {"precision": "fp16", "device": "auto"}
    assert cold.effective["precision"] == "fp32"
    assert cold.effective["device"] == "cpu"
    assert cold.effective["providers"] == ["CPUExecutionProvider"]
    fields = {c["field"] for c in cold.effective["changes"]}
    assert {"backend", "device", "precision"} <= fields
    assert all(c["reason"] for c in cold.effective["changes"])

    warm = builder.build(model, spec)
    assert warm.cache_hit
    assert builder.worker.launches == 1  # no worker for a hit
    assert (warm.key, warm.engine_path) == (cold.key, cold.engine_path)
    assert warm.effective["providers"] == ["CPUExecutionProvider"]
    assert run(warm.engine_path, warm.load_options()).shape == (2, 4)

    # A fresh builder (an agent restart) hits the same entry.
    again = EngineBuilder(builder.state_dir, builder.config, PLATFORM)
    assert again.build(model, spec).cache_hit
    assert again.worker.launches == 0


def test_concurrent_builds_of_one_engine_build_it_once(builder: EngineBuilder, model: Path) -> None:
    results: list[bool] = []

    def build() -> None:
        results.append(builder.build(model, None).cache_hit)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=patient(120))
    assert sorted(results) == [False, True, True]
    assert builder.worker.launches == 1


def test_no_spec_is_fp32_onnxruntime_passthrough(builder: EngineBuilder, model: Path) -> None:
    artifact = builder.build(model, None)
    assert artifact.plan.backend == "onnxruntime"
    assert artifact.plan.precision == "fp32"
    assert artifact.plan.device == "cpu"
    x = np.ones((2, 3, 32, 32), np.float32)
    want = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"images": x})[0]
    np.testing.assert_allclose(run(artifact.engine_path, artifact.load_options()), want, rtol=1e-4, atol=1e-4)


def test_corrupt_entry_is_rebuilt(builder: EngineBuilder, model: Path) -> None:
    first = builder.build(model, None)
    (first.engine_path.parent / SIDECAR_NAME).write_text("garbage", encoding="utf-8")
    second = builder.build(model, None)
    assert not second.cache_hit
    assert builder.worker.launches == 2
    assert second.key == first.key
    assert builder.build(model, None).cache_hit


def test_truncated_engine_is_rebuilt(builder: EngineBuilder, model: Path) -> None:
    first = builder.build(model, None)
    first.engine_path.write_bytes(first.engine_path.read_bytes()[:100])
    assert not builder.build(model, None).cache_hit
    assert builder.worker.launches == 2


def test_spec_change_gives_a_new_key_same_plan_shares_it(builder: EngineBuilder, model: Path) -> None:
    base = builder.build(model, BuildSpec(precision="fp32", device="cpu"))
    other = builder.build(model, BuildSpec(precision="fp32", device="cpu", optimization_level=5))
    assert other.key != base.key
    assert not other.cache_hit
    # fp16 on the CPU plans FP32: the same engine, so the same key and a hit.
    same = builder.build(model, BuildSpec(precision="fp16", device="cpu"))
    assert same.key == base.key
    assert same.cache_hit
    assert builder.worker.launches == 2


def test_model_change_gives_a_new_key(builder: EngineBuilder, tmp_path: Path, model: Path) -> None:
    other = write_classifier(tmp_path / "other.onnx", input_size=32, num_classes=4, seed=7)
    assert builder.build(model, None).key != builder.build(other, None).key


def test_int8_builds_a_qdq_model_that_runs(builder: EngineBuilder, model: Path) -> None:
    spec = BuildSpec(
        precision="int8", device="cpu", calibration=CalibrationSource(kind="stream", stream="cam", frames=12)
    )
    artifact = builder.build(model, spec, calibration=frames(1))
    assert not artifact.cache_hit
    assert artifact.plan.int8_mode == "qdq"
    ops = {node.op_type for node in onnx.load(str(artifact.engine_path)).graph.node}
    assert ops & {"QuantizeLinear", "QLinearConv", "DequantizeLinear"}
    assert run(artifact.engine_path, artifact.load_options()).shape == (2, 4)
    calibration = artifact.effective["calibration"]
    assert Path(calibration["table"]).is_file()
    assert Path(calibration["trt_cache"]).read_bytes().startswith(b"TRT-100300-EntropyCalibration2")
    # 7-bit weights on an x86 CPU without VNNI, 8 elsewhere: part of the key, as it changes the engine.
    entry = builder.cache.get(artifact.key)
    assert entry is not None
    reduced = reduce_range_for("cpu", PLATFORM.machine or "", host_cpu_flags())
    assert entry.meta.identity.extra["int8_weight_bits"] == ("7" if reduced else "8")
    # A stream's frames never repeat: the same stream and frame count reuse the engine.
    consumed: list[int] = []

    def lazy() -> object:
        consumed.append(1)
        yield from frames(2)

    again = builder.build(model, spec, calibration=lazy())  # type: ignore[arg-type]
    assert again.cache_hit
    assert consumed == []  # frames are only read for a build
    assert builder.worker.launches == 1


def test_int8_from_a_dataset_directory(builder: EngineBuilder, tmp_path: Path, model: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(3)
    for i in range(6):
        cv2.imwrite(str(images / f"{i:02d}.png"), rng.integers(0, 255, (48, 64, 3), dtype=np.uint8))
    source = CalibrationSource(kind="dataset", path=images, frames=6)
    spec = BuildSpec(precision="int8", device="cpu", calibration=source)
    artifact = builder.build(model, spec)  # preprocessing from the model's 32x32 input
    assert artifact.plan.precision == "int8"
    assert run(artifact.engine_path, artifact.load_options()).shape == (2, 4)
    # Changing an image changes the calibration identity, hence the key. The new image is another
    # random one: a black first image costs ONNX Runtime's entropy calibration over a minute of CPU.
    before = calibration_identity(source, PreprocessSpec(width=32, height=32))
    cv2.imwrite(str(images / "00.png"), rng.integers(0, 255, (48, 64, 3), dtype=np.uint8))
    assert calibration_identity(source, PreprocessSpec(width=32, height=32)) != before
    assert builder.build(model, spec).key != artifact.key


def test_int8_without_calibration_is_refused_before_any_build(builder: EngineBuilder, model: Path) -> None:
    with pytest.raises(BuildError, match="INT8 needs a calibration"):
        builder.build(model, BuildSpec(precision="int8", device="cpu"))
    assert builder.worker.launches == 0


def test_stream_calibration_without_frames_is_refused(builder: EngineBuilder, model: Path) -> None:
    spec = BuildSpec(
        precision="int8", device="cpu", calibration=CalibrationSource(kind="stream", stream="cam")
    )
    with pytest.raises(BuildError, match="needs frames"):
        builder.build(model, spec)
    assert builder.worker.launches == 0
    assert builder.cache.keys() == []


def test_crash_in_worker_fails_the_build_and_caches_nothing(tmp_path: Path, model: Path) -> None:
    config = EngineConfig(build_timeout_s=60)
    worker = CrashingWorker(timeout_s=60, env=TEST_ENV)
    builder = EngineBuilder(tmp_path / "state", config, PLATFORM, worker=worker)
    with pytest.raises(BuildError, match="builder crashed: SIGSEGV"):
        builder.build(model, None)
    assert builder.cache.keys() == []
    assert list((tmp_path / "state" / "build").iterdir()) == []  # job dir cleaned
    # The same builder works once the worker is healthy again.
    builder.worker = BuildWorker(timeout_s=60)
    assert not builder.build(model, None).cache_hit


def test_protect_passes_through_to_eviction(tmp_path: Path, model: Path) -> None:
    builder = EngineBuilder(tmp_path / "state", EngineConfig(build_timeout_s=patient(120)), PLATFORM)
    first = builder.build(model, None)
    builder.protect({first.key})
    builder.cache.max_bytes = 1  # every new entry overflows the cap
    second = builder.build(model, BuildSpec(precision="fp32", device="cpu", optimization_level=1))
    assert set(builder.cache.keys()) == {first.key, second.key}
    third = builder.build(model, BuildSpec(precision="fp32", device="cpu", optimization_level=2))
    assert set(builder.cache.keys()) == {first.key, third.key}  # second evicted, first protected


def test_model_facts(tmp_path: Path, model: Path) -> None:
    assert model_facts(model) == (False, False)  # dynamic batch, no Q/DQ
