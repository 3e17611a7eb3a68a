"""Classification: top-k, labels, softmax modes, ties, shapes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from agent.camera.preprocess import Letterbox
from agent.errors import ConfigError, EngineError
from agent.postprocess import classification
from agent.postprocess.classification import needs_softmax, numpy_order_sum, softmax
from agent.postprocess.runner import Postprocessor
from agent.specs.postprocess import ClassificationSpec


def _spec(**fields: Any) -> ClassificationSpec:
    return ClassificationSpec.model_validate({"type": "classification", **fields})


def _classify(scores: Any, identity_lb: Letterbox, **fields: Any) -> list[tuple[int, str, float]]:
    prediction = Postprocessor(_spec(**fields))({"scores": np.asarray(scores, dtype=np.float32)}, identity_lb)
    assert prediction.detections is None
    assert prediction.classes is not None
    return [(c.index, c.label, c.score) for c in prediction.classes]


def test_top_k_with_labels_and_fallback(identity_lb: Letterbox) -> None:
    probs = [0.1, 0.6, 0.05, 0.25]
    got = _classify(probs, identity_lb, top_k=3, labels=["cat", "dog", "fox"])
    assert [(i, label) for i, label, _ in got] == [(1, "dog"), (3, "class_3"), (0, "cat")]
    assert [s for *_, s in got] == pytest.approx([0.6, 0.25, 0.1])  # already probabilities: kept


def test_softmax_auto_applies_to_logits(identity_lb: Letterbox) -> None:
    logits = [2.0, -1.0, 0.5]
    got = _classify(logits, identity_lb, top_k=3)
    expected = np.exp(logits) / np.exp(logits).sum()
    assert [i for i, *_ in got] == [0, 2, 1]
    assert [s for *_, s in got] == pytest.approx(sorted(expected, reverse=True), rel=1e-6)


def test_softmax_modes(identity_lb: Letterbox) -> None:
    probs = [0.2, 0.8]
    assert [s for *_, s in _classify(probs, identity_lb, softmax="never")] == pytest.approx([0.8, 0.2])
    forced = _classify(probs, identity_lb, softmax="always")
    assert [s for *_, s in forced] == pytest.approx([np.exp(0.6) / (1 + np.exp(0.6)), 1 / (1 + np.exp(0.6))])
    logits = [3.0, 1.0]
    assert [s for *_, s in _classify(logits, identity_lb, softmax="never")] == pytest.approx([3.0, 1.0])


def test_needs_softmax_auto() -> None:
    assert not needs_softmax(np.array([0.5, 0.5]), "auto")
    assert needs_softmax(np.array([0.5, 0.6]), "auto")  # sums to 1.1
    assert needs_softmax(np.array([1.2, -0.2]), "auto")  # sums to 1 but negative
    assert needs_softmax(np.array([0.5, 0.5]), "always")
    assert not needs_softmax(np.array([5.0]), "never")


def test_softmax_is_numerically_stable() -> None:
    out = softmax(np.array([1000.0, 1001.0, -1000.0], dtype=np.float32))
    assert np.isfinite(out).all()
    assert out.sum() == pytest.approx(1.0)
    assert out[1] / out[0] == pytest.approx(np.e)


def test_ties_keep_index_order(identity_lb: Letterbox) -> None:
    got = _classify([0.25, 0.25, 0.25, 0.25], identity_lb, top_k=4)
    assert [i for i, *_ in got] == [0, 1, 2, 3]
    got = _classify([1.0, 3.0, 3.0, 1.0, 3.0], identity_lb, top_k=5)
    assert [i for i, *_ in got] == [1, 2, 4, 0, 3]


def test_top_k_larger_than_classes(identity_lb: Letterbox) -> None:
    assert len(_classify([0.3, 0.7], identity_lb, top_k=10)) == 2


def test_conv_style_output_shape_accepted(identity_lb: Letterbox) -> None:
    scores = np.array([0.1, 0.9], dtype=np.float32).reshape(2, 1, 1)
    assert [i for i, *_ in _classify(scores, identity_lb, top_k=1)] == [1]


def test_matrix_output_is_an_engine_error(identity_lb: Letterbox) -> None:
    with pytest.raises(EngineError, match="expected \\[classes\\]"):
        _classify(np.zeros((3, 4)), identity_lb)


def test_output_name_selects_output(identity_lb: Letterbox) -> None:
    post = Postprocessor(_spec(output_name="b", top_k=1))
    outputs = {"a": np.array([0.9, 0.1], np.float32), "b": np.array([0.1, 0.9], np.float32)}
    prediction = post(outputs, identity_lb)
    assert prediction.classes is not None
    assert prediction.classes[0].index == 1
    with pytest.raises(EngineError, match=r"output 'b'.*a"):
        post({"a": outputs["a"]}, identity_lb)


def test_labels_file_relative_to_base_dir(tmp_path: Path, identity_lb: Letterbox) -> None:
    (tmp_path / "labels.txt").write_text("zero\none\n\n", encoding="utf-8")
    post = Postprocessor(_spec(labels_file="labels.txt", top_k=2), base_dir=tmp_path)
    assert post.labels == ["zero", "one"]
    prediction = post({"s": np.array([0.3, 0.7], np.float32)}, identity_lb)
    assert prediction.classes is not None
    assert [c.label for c in prediction.classes] == ["one", "zero"]


def test_unreadable_labels_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"labels_file.*missing\.txt") as info:
        Postprocessor(_spec(labels_file="missing.txt"), base_dir=tmp_path)
    assert info.value.problems[0].startswith("postprocess.labels_file")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\xfa")
    with pytest.raises(ConfigError, match="UTF-8"):
        Postprocessor(_spec(labels_file=tmp_path / "bad.txt"))


def test_labels_and_labels_file_together_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "l.txt").write_text("a\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="not both"):
        Postprocessor(_spec(labels=["a"], labels_file="l.txt"), base_dir=tmp_path)


@pytest.mark.parametrize("softmax_mode", ["auto", "always", "never"])
def test_short_vectors_take_the_python_path_with_the_numpy_paths_results(
    softmax_mode: str, identity_lb: Letterbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(7)
    vectors: list[npt.NDArray[Any]] = [
        *(rng.standard_normal(n).astype(np.float32) * 4 for n in (1, 2, 7, 8, 9, 10, 17, 32)),
        *(rng.dirichlet(np.ones(n)).astype(np.float32) for n in (3, 10, 31)),
        np.array([1.0, 3.0, 3.0, 1.0, 3.0], np.float16),  # ties, half precision
        np.array([0.0, -0.0, 0.0], np.float32),
        np.array([1.0, float("nan"), 0.5], np.float32),  # NaN: the numpy path decides
        np.array([float("inf"), 1.0], np.float32),
    ]
    post = Postprocessor(_spec(top_k=5, softmax=softmax_mode))
    with np.errstate(invalid="ignore"):  # inf - inf in the numpy path's softmax: NaN, as always
        small = [post({"s": v}, identity_lb).classes for v in vectors]
        monkeypatch.setattr(classification, "SMALL_VECTOR", 0)
        through_numpy = [post({"s": v}, identity_lb).classes for v in vectors]
    for fast, reference in zip(small, through_numpy, strict=True):
        assert fast is not None
        assert reference is not None
        assert [c.index for c in fast] == [c.index for c in reference]
        # To the bit where numpy's exp is the C library's (this x86 machine); else within rounding.
        assert [c.score for c in fast] == pytest.approx([c.score for c in reference], rel=1e-12, nan_ok=True)


def test_numpy_order_sum_adds_as_numpy_does() -> None:
    rng = np.random.default_rng(3)
    for n in [*range(1, 20), 31, 32, 64, 127, 128]:
        values = rng.random(n) * 10.0 ** rng.integers(-3, 5, n)
        assert numpy_order_sum(values.tolist()) == float(values.sum())
