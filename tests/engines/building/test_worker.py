"""The build worker: real child processes that build, segfault, hang or run out of memory."""

from __future__ import annotations

import importlib
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from agent.demo.modelzoo import write_classifier
from agent.engines.building.worker import BuildWorker, signal_name
from agent.engines.building.worker_child import TEST_JOBS_ENV, raised_during_import
from agent.engines.calibration.data import load_batches, save_batches
from agent.engines.job import BuildJob
from agent.errors import BuildError
from agent.specs.build import BuildPlan
from tests.engines.failing_jobs import TEST_ENV
from tests.waiting import patient

CPU_PLAN = BuildPlan(backend="onnxruntime", precision="fp32", device="cpu")


def job(tmp_path: Path, kind: str, model: Path | None = None) -> BuildJob:
    return BuildJob.model_validate(
        {
            "kind": kind,
            "model": model or tmp_path / "none.onnx",
            "out_dir": tmp_path / f"out-{kind}",
            "plan": CPU_PLAN,
            "engine_file": "model.onnx",
        }
    )


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_classifier(tmp_path / "classifier.onnx", input_size=32, num_classes=4)


def test_onnxruntime_build_in_a_child(tmp_path: Path, model: Path) -> None:
    worker = BuildWorker(timeout_s=120)
    lines: list[str] = []
    result = worker.run(job(tmp_path, "onnxruntime", model), lines.append)
    assert worker.launches == 1
    engine = tmp_path / "out-onnxruntime" / result.engine_file
    assert engine.is_file()
    assert result.report["providers"] == ["CPUExecutionProvider"]
    assert any("optimizing" in line for line in lines)
    session = ort.InferenceSession(str(engine), providers=["CPUExecutionProvider"])
    (scores,) = session.run(None, {"images": np.zeros((2, 3, 32, 32), np.float32)})
    assert scores.shape == (2, 4)


def test_segfaulting_builder_is_named_and_parent_stays_healthy(tmp_path: Path, model: Path) -> None:
    worker = BuildWorker(timeout_s=60, env=TEST_ENV)
    lines: list[str] = []
    with pytest.raises(BuildError, match="builder crashed: SIGSEGV") as info:
        worker.run(job(tmp_path, "crash"), lines.append)
    assert lines == ["about to crash"]
    # faulthandler's report is in the child's stderr tail.
    assert "Fatal Python error" in str(info.value) or "Segmentation fault" in str(info.value)
    # The same worker (and this process) builds normally afterwards.
    result = worker.run(job(tmp_path, "onnxruntime", model))
    assert (tmp_path / "out-onnxruntime" / result.engine_file).is_file()
    assert worker.launches == 2


def test_hanging_builder_times_out_and_its_process_group_is_killed(tmp_path: Path) -> None:
    worker = BuildWorker(timeout_s=1.5, env=TEST_ENV)
    pids: list[int] = []
    started = time.monotonic()
    with pytest.raises(BuildError, match=r"build timed out after 1.5s"):
        worker.run(job(tmp_path, "hang"), lambda _line: pids.append(1))
    assert pids == [1]  # it did start and report progress
    assert time.monotonic() - started < 30  # generous: the kill happened, no waiting forever


def test_cancel_kills_the_build(tmp_path: Path) -> None:
    worker = BuildWorker(timeout_s=60, env=TEST_ENV)
    cancel = threading.Event()
    timer = threading.Timer(0.5, cancel.set)
    timer.start()
    try:
        with pytest.raises(BuildError, match="cancelled"):
            worker.run(job(tmp_path, "hang"), cancel=cancel)
    finally:
        timer.cancel()


def test_memory_limit_gives_a_clear_message(tmp_path: Path) -> None:
    worker = BuildWorker(timeout_s=60, memory_mb=512, env=TEST_ENV)
    with pytest.raises(BuildError, match="out of memory") as info:
        worker.run(job(tmp_path, "memory"))
    assert "engines.build_memory_mb" in str(info.value)
    assert "512 MB" in str(info.value)


def test_a_real_build_under_a_tiny_memory_limit_names_the_limit(tmp_path: Path, model: Path) -> None:
    """48 MB cannot hold Python with ONNX Runtime: however the child dies (MemoryError, an odd error
    from the import machinery, a signal), the message says it was the memory limit and what to raise."""
    worker = BuildWorker(timeout_s=120, memory_mb=48)
    with pytest.raises(BuildError) as info:
        worker.run(job(tmp_path, "onnxruntime", model))
    assert "48 MB" in str(info.value)
    assert "engines.build_memory_mb" in str(info.value)


def test_an_error_raised_by_an_import_is_told_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "explodes_on_import.py").write_text("raise ValueError('half-built AST')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="half-built") as during_import:
        importlib.import_module("explodes_on_import")
    assert raised_during_import(during_import.value)
    with pytest.raises(ValueError, match="plain") as plain:
        raise ValueError("plain")
    assert not raised_during_import(plain.value)


def test_test_jobs_are_refused_without_the_env_var(tmp_path: Path) -> None:
    assert os.environ.get(TEST_JOBS_ENV) is None
    worker = BuildWorker(timeout_s=60)
    with pytest.raises(BuildError, match="for tests only"):
        worker.run(job(tmp_path, "crash"))


def test_builder_error_message_is_passed_through(tmp_path: Path) -> None:
    (tmp_path / "broken.onnx").write_bytes(b"not an onnx model")
    worker = BuildWorker(timeout_s=60)
    with pytest.raises(BuildError, match="cannot load") as info:
        worker.run(job(tmp_path, "onnxruntime", tmp_path / "broken.onnx"))
    assert "broken.onnx" in str(info.value)


def test_one_build_at_a_time(tmp_path: Path, model: Path) -> None:
    """A second build waits for the first: the hang is killed by its timeout before the next runs."""
    # The timeout counts from the child's start: on a loaded machine its imports alone may take a
    # second, and the hang must have said it started before it is killed.
    worker = BuildWorker(timeout_s=patient(1.0), env=TEST_ENV, lock_path=tmp_path / "build.lock")
    order: list[str] = []
    errors: list[BaseException] = []

    def hang() -> None:
        try:
            worker.run(job(tmp_path, "hang"), lambda _m: order.append("hang started"))
        except BuildError as exc:
            order.append("hang ended")
            errors.append(exc)

    thread = threading.Thread(target=hang)
    thread.start()
    deadline = time.monotonic() + patient(30)
    while not order and time.monotonic() < deadline:
        time.sleep(0.02)
    second = BuildWorker(timeout_s=60, lock_path=tmp_path / "build.lock")  # another "process"
    second.run(job(tmp_path, "onnxruntime", model), lambda _m: order.append("build progress"))
    thread.join(timeout=patient(30))
    assert order[0] == "hang started"
    assert order.index("hang ended") < order.index("build progress")
    assert errors


def test_save_and_load_batches_round_trip(tmp_path: Path) -> None:
    batches = [np.full((2, 3, 4, 4), i, np.float32) for i in range(3)]
    count, digest = save_batches(batches, tmp_path / "calib")
    assert count == 3
    loaded = list(load_batches(tmp_path / "calib"))
    assert all(np.array_equal(a, b) for a, b in zip(batches, loaded, strict=True))
    _, same = save_batches(batches, tmp_path / "again")
    _, other = save_batches([b + 1 for b in batches], tmp_path / "other")
    assert digest == same != other


def test_signal_names() -> None:
    assert signal_name(int(signal.SIGSEGV)) == "SIGSEGV"
    assert signal_name(int(signal.SIGKILL)) == "SIGKILL"
    assert signal_name(250) == "signal 250"
