"""ModelSlot and LoadedModel: state tables, load, rejected candidates, leases across a swap."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agent.config import SlotConfig
from agent.demo.modelzoo import write_classifier
from agent.errors import EngineError
from agent.protocol.messages import EngineInfo
from agent.runtime.slots.loaded import MODEL_TRANSITIONS, LoadedModel, ModelSource, ModelState
from agent.runtime.slots.models.sources import model_source
from agent.runtime.slots.slot import SLOT_TRANSITIONS, ModelSlot, SlotState
from agent.specs.postprocess import ClassificationSpec
from agent.specs.preprocess import PreprocessSpec
from tests.runtime.models import write_nan_classifier

SIZE = 32
CLASSES = 4


def source(path: Path, version: str = "1", size: int = SIZE) -> ModelSource:
    return ModelSource(
        path=path,
        model_id="cls",
        version=version,
        backend="onnxruntime",
        providers=("CPUExecutionProvider",),
        intra_op_threads=1,
        preprocess=PreprocessSpec(width=size, height=size),
        postprocess=ClassificationSpec(top_k=2),
    )


def state(thing: ModelSlot | LoadedModel) -> SlotState | ModelState:
    """The current state (a call, so mypy does not narrow it across the state changes under test)."""
    return thing.state


def frame() -> np.ndarray:
    return np.random.default_rng(3).integers(0, 255, (48, 64, 3), dtype=np.uint8)


def run(model: LoadedModel) -> np.ndarray:
    tensor = np.random.default_rng(0).random((1, 3, SIZE, SIZE), dtype=np.float32)
    return model.runner.infer({model.input_name: tensor})["scores"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("slot-models")
    v1 = write_classifier(root / "v1.onnx", input_size=SIZE, num_classes=CLASSES, seed=1)
    truncated = root / "truncated.onnx"
    truncated.write_bytes(v1.read_bytes()[:200])
    return {
        "v1": v1,
        "v2": write_classifier(root / "v2.onnx", input_size=SIZE, num_classes=CLASSES, seed=2),
        "truncated": truncated,
        "wrong_size": write_classifier(root / "w.onnx", input_size=SIZE * 2, num_classes=CLASSES, seed=3),
        "nan": write_nan_classifier(root / "nan.onnx", input_size=SIZE, classes=CLASSES),
    }


def test_slot_state_table_rejects_every_transition_it_does_not_list() -> None:
    for old in SlotState:
        for new in SlotState:
            slot = ModelSlot("s")
            slot._state = old  # set up the precondition directly: the table is what is under test
            if new in SLOT_TRANSITIONS[old]:
                slot._transition(new)
                assert state(slot) is new
            else:
                with pytest.raises(RuntimeError, match="illegal transition"):
                    slot._transition(new)
                assert state(slot) is old


def test_model_state_table_rejects_illegal_transitions(models: dict[str, Path]) -> None:
    slot = ModelSlot("s")
    model = slot.load(source(models["v1"]))
    assert state(model) is ModelState.ACTIVE
    for illegal in (ModelState.LOADING, ModelState.VALIDATING, ModelState.RELEASED, ModelState.ACTIVE):
        assert illegal not in MODEL_TRANSITIONS[ModelState.ACTIVE]
        with pytest.raises(RuntimeError, match="illegal transition active"):
            model.transition(illegal)
    assert state(model) is ModelState.ACTIVE
    assert MODEL_TRANSITIONS[ModelState.RELEASED] == frozenset()
    assert MODEL_TRANSITIONS[ModelState.FAILED] == frozenset()
    slot.close()


def test_load_goes_through_validation_to_active(models: dict[str, Path]) -> None:
    seen: list[tuple[str, SlotState, SlotState]] = []
    slot = ModelSlot("cls", on_transition=lambda name, old, new: seen.append((name, old, new)))
    assert state(slot) is SlotState.EMPTY
    assert slot.describe()["model"] is None
    model = slot.load(source(models["v1"]), frame())
    assert state(slot) is SlotState.ACTIVE
    assert slot.current is model
    assert state(model) is ModelState.ACTIVE
    assert model.ref.slot == "cls"
    assert model.ref.version == "1"
    assert len(model.ref.sha256) == 64
    assert seen == [
        ("cls", SlotState.EMPTY, SlotState.LOADING),
        ("cls", SlotState.LOADING, SlotState.VALIDATING),
        ("cls", SlotState.VALIDATING, SlotState.ACTIVE),
    ]
    assert run(model).shape == (1, CLASSES)
    assert slot.describe()["model"]["model_id"] == "cls"
    slot.close()


@pytest.mark.parametrize(
    ("candidate", "reason"),
    [
        ("truncated", "ONNX Runtime cannot load"),
        ("wrong_size", "axis 2 is 64 but preprocess produces 32"),
        ("nan", "NaN or infinite"),
    ],
)
def test_a_rejected_candidate_leaves_the_old_model_serving(
    models: dict[str, Path], candidate: str, reason: str
) -> None:
    slot = ModelSlot("cls")
    old = slot.load(source(models["v1"]))
    expected = run(old)
    with pytest.raises(EngineError, match=reason):
        slot.load(source(models[candidate], version="2"), frame())
    assert state(slot) is SlotState.ACTIVE
    assert slot.current is old
    assert state(old) is ModelState.ACTIVE
    assert slot.failed_loads == 1
    assert slot.last_error is not None
    assert reason in slot.last_error
    assert slot.swaps == 0
    with slot.lease() as model:
        assert model is old
        np.testing.assert_array_equal(run(model), expected)
    # The slot is not wedged: a good model still swaps in afterwards.
    new = slot.load(source(models["v2"], version="2"))
    assert slot.current is new
    assert state(old) is ModelState.RELEASED
    slot.close()


def test_a_rejected_first_model_leaves_the_slot_empty(models: dict[str, Path]) -> None:
    slot = ModelSlot("cls")
    with pytest.raises(EngineError, match="NaN"):
        slot.load(source(models["nan"]))
    assert state(slot) is SlotState.EMPTY
    assert slot.current is None
    with slot.lease() as model:
        assert model is None
    with pytest.raises(EngineError, match="does not exist"):
        slot.load(source(models["v1"].with_name("missing.onnx")))
    assert state(slot) is SlotState.EMPTY
    assert slot.failed_loads == 2


def test_a_lease_keeps_the_old_model_open_across_a_swap(models: dict[str, Path]) -> None:
    slot = ModelSlot("cls")
    old = slot.load(source(models["v1"]))
    with slot.lease() as leased:
        assert leased is old
        assert old.leases == 1
        new = slot.load(source(models["v2"], version="2"))
        assert slot.current is new
        assert slot.swaps == 1
        assert state(old) is ModelState.DRAINING
        run(old)  # the in-flight batch still runs on the old runner
        with slot.lease() as later:
            assert later is new  # a new batch gets the new model
    assert old.leases == 0
    assert state(old) is ModelState.RELEASED
    with pytest.raises(EngineError, match="closed"):
        run(old)
    assert state(new) is ModelState.ACTIVE
    run(new)
    slot.close()
    assert state(new) is ModelState.RELEASED


def test_retire_without_leases_releases_at_once(models: dict[str, Path]) -> None:
    slot = ModelSlot("cls")
    old = slot.load(source(models["v1"]))
    slot.load(source(models["v2"], version="2"))
    assert state(old) is ModelState.RELEASED
    with pytest.raises(EngineError, match="closed"):
        run(old)
    slot.close()


def test_onnx_runtime_threads_spin_only_when_asked(models: dict[str, Path]) -> None:
    """Spinning pool threads burned most of a core between camera frames; off unless the slot asks."""
    slot = ModelSlot("cls")
    quiet = slot.load(source(models["v1"]))
    assert quiet.runner.describe()["allow_spinning"] is False
    spinning = ModelSource(**{**source(models["v2"]).__dict__, "allow_spinning": True})
    busy = slot.load(spinning)
    assert busy.runner.describe()["allow_spinning"] is True
    run(busy)
    slot.close()


def test_the_slot_config_reaches_the_runner(tmp_path: Path) -> None:
    """Thread and spinning settings of a configured slot end up in the loaded ONNX Runtime session."""
    model = write_classifier(tmp_path / "m.onnx", input_size=32, num_classes=4, seed=1)
    config = SlotConfig.model_validate(
        {
            "model": str(model),
            "intra_op_threads": 2,
            "allow_spinning": True,
            "preprocess": {"width": 32, "height": 32},
        }
    )
    slot = ModelSlot("cls")
    loaded = slot.load(model_source(config))
    described = loaded.runner.describe()
    slot.close()
    assert described["intra_op_threads"] == "2"
    assert described["allow_spinning"] is True


def test_an_onnx_runtime_model_is_preprocessed_on_the_cpu_and_up_info_says_why(
    models: dict[str, Path],
) -> None:
    slot = ModelSlot("cls")
    model = slot.load(source(models["v1"]), frame())
    try:
        assert model.gpu_preprocessor is None
        assert not model.preprocessed_on_gpu
        (row,) = model.engine_shares()
        info = EngineInfo.model_validate(row)
        assert info.preprocess == "cpu"
        assert info.preprocess_reason == (
            "the onnxruntime runner takes host arrays; GPU preprocessing feeds TensorRT engines only"
        )
    finally:
        slot.close()
