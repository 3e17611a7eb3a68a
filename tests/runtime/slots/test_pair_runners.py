"""The runners a pair runs on: the model's own where it runs on the caller, else a one-thread copy."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from agent.demo.modelzoo import write_classifier
from agent.runtime.slots.pair_runners import PairRunners
from agent.runtime.slots.slot import ModelSlot
from tests.runtime.slots.test_slot import source


def test_a_copy_that_cannot_be_loaded_leaves_the_pair_on_the_models_own_runner(tmp_path: Path) -> None:
    """The engine file is gone by the first pair (a disk cleaned meanwhile): the pair is timed on the
    pool's wall time, and the model keeps serving."""
    path = write_classifier(tmp_path / "v1.onnx", input_size=32, num_classes=4, seed=1)
    slot = ModelSlot("pooled")
    model = slot.load(dataclasses.replace(source(path), intra_op_threads=2))
    path.unlink()
    runners = PairRunners()

    assert runners(model) is model.runner
    assert not model.runner.runs_on_caller
    runners.close()
    scores = model.runner.infer({model.input_name: np.zeros((1, 3, 32, 32), np.float32)})["scores"]
    assert scores.shape == (1, 4)
    slot.close()


def test_each_model_gets_one_copy_for_the_whole_run(tmp_path: Path) -> None:
    path = write_classifier(tmp_path / "v1.onnx", input_size=32, num_classes=4, seed=1)
    slot = ModelSlot("pooled")
    model = slot.load(dataclasses.replace(source(path), intra_op_threads=2))
    runners = PairRunners()

    copy = runners(model)

    assert copy is not model.runner
    assert runners(model) is copy
    assert copy.describe()["intra_op_threads"] == "1 (on the caller, for timing)"
    runners.close()
    slot.close()
