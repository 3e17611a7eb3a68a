"""A TensorRT build that fails falls back to ONNX Runtime, unless the build spec says ``fallback: none``.

TensorRT is absent here, so the planner's choice is forced: :data:`FORCED_TRT` is a platform that
claims TensorRT 10.3 and a GPU (a fake for absent hardware). The TensorRT build then runs for real in
the build child and fails there (TensorRT cannot be imported), or the child crashes for real
(SIGSEGV, :class:`TrtCrashingWorker`); the fallback is a real ONNX Runtime build.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from agent.backends.base import get_backend
from agent.demo.modelzoo import write_classifier
from agent.engines.building.builder import EngineBuilder
from agent.engines.building.worker import BuildWorker
from agent.engines.job import BuildJob, Progress, WorkerResult
from agent.engines.settings import EngineConfig
from agent.errors import BuildError
from agent.machine.platform import BackendAvailability, Platform
from agent.specs.build import BuildSpec
from tests.engines.failing_jobs import TEST_ENV

#: A fake platform for absent hardware: it claims TensorRT and a GPU so the planner picks TensorRT;
#: ONNX Runtime has only its CPU provider, as on this machine.
FORCED_TRT = Platform(
    machine="x86_64",
    gpu_name="Orin (fake: forces the TensorRT plan)",
    compute_capability="8.7",
    dla_cores=0,
    tensorrt_version="10.3.0",
    onnxruntime_version=ort.__version__,
    ort_providers=("CPUExecutionProvider",),
    backends={
        "onnxruntime": BackendAvailability(True, "onnxruntime"),
        "tensorrt": BackendAvailability(True, "TensorRT 10.3.0 (fake)"),
    },
)


class TrtCrashingWorker(BuildWorker):
    """Runs TensorRT jobs as the test-only 'crash' kind (a real child that segfaults); others as asked."""

    def run(
        self, job: BuildJob, progress: Progress | None = None, cancel: threading.Event | None = None
    ) -> WorkerResult:
        if job.kind == "tensorrt":
            job = job.model_copy(update={"kind": "crash"})
        return super().run(job, progress, cancel)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_classifier(tmp_path / "classifier.onnx", input_size=32, num_classes=4)


def _builder(tmp_path: Path, worker: BuildWorker | None = None) -> EngineBuilder:
    return EngineBuilder(tmp_path / "state", EngineConfig(build_timeout_s=120), FORCED_TRT, worker=worker)


def test_the_forced_platform_plans_tensorrt(tmp_path: Path, model: Path) -> None:
    plan = _builder(tmp_path).plan(model, BuildSpec(precision="fp16", device="gpu"))
    assert plan.backend == "tensorrt"


def test_a_failed_tensorrt_build_falls_back_to_onnxruntime_and_says_why(tmp_path: Path, model: Path) -> None:
    messages: list[str] = []
    artifact = _builder(tmp_path).build(
        model, BuildSpec(precision="fp16", device="gpu"), progress=messages.append
    )
    assert artifact.backend == "onnxruntime"
    assert artifact.plan.device == "cpu"  # the best provider present here
    fallback = artifact.effective["fallback"]
    assert fallback["from"] == "tensorrt"
    assert fallback["to"] == "onnxruntime"
    assert "TensorRT" in fallback["reason"]
    backend_change = next(c for c in artifact.effective["changes"] if c["field"] == "backend")
    assert backend_change["requested"] == "tensorrt"
    assert backend_change["effective"] == "onnxruntime"
    assert "the TensorRT build failed" in backend_change["reason"]
    assert any(m.startswith("TensorRT build failed") for m in messages)
    # The fallback engine runs.
    runner = get_backend("onnxruntime").load(artifact.engine_path, artifact.load_options())
    try:
        scores = runner.infer({"images": np.ones((1, 3, 32, 32), np.float32)})["scores"]
    finally:
        runner.close()
    assert scores.shape == (1, 4)


def test_a_crashing_tensorrt_child_falls_back(tmp_path: Path, model: Path) -> None:
    builder = _builder(tmp_path, TrtCrashingWorker(timeout_s=60, env=TEST_ENV))
    artifact = builder.build(model, BuildSpec(precision="fp16", device="gpu"))
    assert artifact.backend == "onnxruntime"
    assert "SIGSEGV" in artifact.effective["fallback"]["reason"]
    assert "Segmentation fault" in artifact.effective["fallback"]["error"]  # the child's last output
    assert len(builder.cache.keys()) == 1  # only the ONNX Runtime engine: nothing of the crash


def test_fallback_none_fails_the_build_with_the_tensorrt_error(tmp_path: Path, model: Path) -> None:
    builder = _builder(tmp_path, TrtCrashingWorker(timeout_s=60, env=TEST_ENV))
    spec = BuildSpec(precision="fp16", device="gpu", fallback="none")
    with pytest.raises(BuildError, match=r"(?s)TensorRT build failed and .* fallback: none.*SIGSEGV"):
        builder.build(model, spec)
    assert builder.cache.keys() == []


def test_a_cancelled_tensorrt_build_does_not_fall_back(tmp_path: Path, model: Path) -> None:
    cancel = threading.Event()
    cancel.set()
    builder = _builder(tmp_path)
    with pytest.raises(BuildError, match="cancelled"):
        builder.build(model, BuildSpec(precision="fp16", device="gpu"), cancel=cancel)
    assert builder.cache.keys() == []
