"""Raw tensors: flattening, truncation, shape."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from agent.camera.preprocess import Letterbox
from agent.model_contract.outputs import validate_outputs
from agent.model_contract.tensors import TensorSpec
from agent.postprocess.runner import Postprocessor
from agent.specs.postprocess import RawSpec


def test_outputs_flattened_and_truncated(identity_lb: Letterbox) -> None:
    post = Postprocessor(RawSpec.model_validate({"type": "raw", "max_values": 5}))
    outputs: dict[str, npt.NDArray[Any]] = {
        "big": np.arange(24, dtype=np.float32).reshape(2, 3, 4),
        "small": np.array([[1.5], [2.5]], dtype=np.float16),
        "ints": np.array([7, 8, 9, 10, 11], dtype=np.int64),
    }
    prediction = post(outputs, identity_lb)
    assert prediction.classes is None
    assert prediction.tensors is not None
    big, small, ints = prediction.tensors
    assert (big.name, big.shape, big.values, big.truncated) == ("big", [2, 3, 4], [0, 1, 2, 3, 4], True)
    assert (small.name, small.shape, small.values, small.truncated) == ("small", [2, 1], [1.5, 2.5], False)
    assert (ints.values, ints.truncated) == ([7, 8, 9, 10, 11], False)  # exactly max_values fits


def test_zero_values_keeps_shapes(identity_lb: Letterbox) -> None:
    post = Postprocessor(RawSpec.model_validate({"type": "raw", "max_values": 0}))
    prediction = post({"x": np.ones((1, 2), np.float32)}, identity_lb)
    assert prediction.tensors is not None
    assert prediction.tensors[0].values == []
    assert prediction.tensors[0].shape == [1, 2]
    assert prediction.tensors[0].truncated


def test_raw_accepts_any_outputs() -> None:
    validate_outputs(
        RawSpec.model_validate({"type": "raw"}), [TensorSpec("anything", ("batch", 3, 7, 7, 2), "float16")]
    )
