"""select_input and check_input_fits: which model input a slot feeds, and whether its shape fits."""

from __future__ import annotations

import pytest

from agent.errors import EngineError
from agent.model_contract.input_fit import check_input_fits, select_input
from agent.model_contract.tensors import TensorSpec
from agent.specs.preprocess import PreprocessSpec

PRE = PreprocessSpec(width=64, height=64)


def test_input_selection_and_fit() -> None:
    spec = TensorSpec("images", ("batch", 3, 64, 64), "float32")
    assert select_input(PRE, [spec]) is spec
    check_input_fits(PRE, spec)
    check_input_fits(PRE, TensorSpec("images", ("batch", 3, "h", "w"), "float32"))  # dynamic fits
    with pytest.raises(EngineError, match="axis 3 is 64 but preprocess produces 32"):
        check_input_fits(PreprocessSpec(width=32, height=64), spec)
    with pytest.raises(EngineError, match="3 axes"):
        check_input_fits(PRE, TensorSpec("x", ("batch", 3, 64), "float32"))
    with pytest.raises(EngineError, match=r"set preprocess\.input_name"):
        select_input(PRE, [spec, TensorSpec("other", (1,), "float32")])
