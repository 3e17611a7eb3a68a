"""A pair timed on real ONNX Runtime sessions while another Python thread keeps the GIL busy.

The probation's thread times a pair now and then (twice a second), and meanwhile the agent's other
threads take the GIL. Waiting for it back lands on both models' wall times alike and pulls their
ratio towards 1 (here the wall times of a model several times costlier read about 1.3 times the
other's). A model run on the calling thread alone is timed by that thread's CPU time, which does not
count the wait; a model given a thread pool is timed on a copy of it that runs on the caller.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from agent.demo.modelzoo import write_classifier
from agent.errors import EngineError
from agent.runtime.slots.latency import compared_times, old_first
from agent.runtime.slots.pair_runners import PairRunners
from agent.runtime.slots.shadow import predict, predict_pair
from agent.runtime.slots.slot import ModelSlot
from tests.runtime.models import write_slower
from tests.runtime.slots.test_slot import source


@pytest.fixture
def gil_busy() -> Iterator[None]:
    """A thread that runs Python bytecode without pause, as the agent's capture and MQTT threads do
    between their waits."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(i * i for i in range(20000))

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def test_a_costlier_model_keeps_its_cpu_time_ratio_while_the_gil_is_busy(
    tmp_path: Path, gil_busy: None
) -> None:
    base = write_classifier(tmp_path / "v1.onnx", input_size=32, num_classes=4, seed=1)
    serving, candidate = ModelSlot("serving"), ModelSlot("candidate")
    # One intra-op thread, as the agent picks for a model this small: the run is the caller's.
    old = serving.load(source(write_slower(base, tmp_path / "old.onnx", dim=192, repeats=2)))
    new = candidate.load(source(write_slower(base, tmp_path / "new.onnx", dim=192, repeats=24)))
    image = np.full((48, 64, 3), 90, np.uint8)
    ratios = []
    for i in range(15):
        threading.Event().wait(0.1)  # the pace of the probation's pairs: the spinning thread takes the GIL
        first, second = (old, new) if old_first(i) else (new, old)
        _, first_time, _ = predict(first, image)
        _, second_time, _ = predict(second, image)
        old_time, new_time = (first_time, second_time) if first is old else (second_time, first_time)
        assert old_time.cpu_ms is not None
        assert new_time.cpu_ms is not None
        old_ms, new_ms = compared_times(old_time, new_time)
        ratios.append(new_ms / old_ms)
    serving.close()
    candidate.close()
    # Twenty-two more products of 192x192: several times the serving model's work, whatever the GIL did.
    assert statistics.median(ratios) > 3.0, ratios


def test_a_model_with_a_thread_pool_is_timed_by_cpu_time_on_a_copy_that_runs_on_the_caller(
    tmp_path: Path, gil_busy: None
) -> None:
    """Two intra-op threads: part of each run is on ONNX Runtime's pool thread, which the caller's CPU
    time leaves out, so the model's own runner gives no CPU time. The pair's runners load the same
    file once more with one thread for the pairs, and close it after; the model keeps its own."""
    base = write_classifier(tmp_path / "v1.onnx", input_size=32, num_classes=4, seed=1)
    serving, candidate = ModelSlot("serving"), ModelSlot("candidate")
    old = serving.load(source(write_slower(base, tmp_path / "old.onnx", dim=192, repeats=2)))
    pooled = source(write_slower(base, tmp_path / "new.onnx", dim=192, repeats=24))
    new = candidate.load(dataclasses.replace(pooled, intra_op_threads=2))
    image = np.full((48, 64, 3), 90, np.uint8)
    assert not new.runner.runs_on_caller
    assert predict(new, image)[1].cpu_ms is None  # its own runner: wall time only

    runners = PairRunners()
    ratios = []
    for i in range(15):
        threading.Event().wait(0.1)
        pair = predict_pair(old, new, image, i, runners)
        ratios.append(pair.new_ms / pair.old_ms)
    copy = runners(new)
    assert copy is not new.runner
    assert copy.runs_on_caller
    assert runners(old) is old.runner  # already on the caller: no copy
    assert predict(new, image, copy)[1].cpu_ms is not None
    runners.close()
    with pytest.raises(EngineError, match="closed"):
        copy.infer({new.input_name: np.zeros((1, 3, 32, 32), np.float32)})
    assert predict(new, image)[0].classes  # the model's own runner still serves
    serving.close()
    candidate.close()
    assert statistics.median(ratios) > 3.0, ratios
