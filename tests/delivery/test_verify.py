"""verify_model on real ONNX files: size limit, unreadable, checker, and slot fit (inputs and outputs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.delivery.verify import verify_model
from agent.demo.modelzoo import write_classifier, write_detector
from agent.protocol.delivery_errors import RejectedError
from agent.protocol.manifest import build_manifest
from agent.specs.postprocess import ClassificationSpec, DetectionSpec, PostprocessSpec, RawSpec
from agent.specs.preprocess import PreprocessSpec
from tests.runtime.models import write_checker_failure

PRE = PreprocessSpec(width=64, height=64)


def _verify(
    path: Path, *, max_bytes: int = 10**8, pre: PreprocessSpec = PRE, post: PostprocessSpec | None = None
) -> None:
    manifest = build_manifest(
        path, job_id="j", sequence=1, slot="main", model_id="m", version="1", chunk_size=1024
    )
    verify_model(
        path, manifest, max_bytes=max_bytes, preprocess=pre, postprocess=post or ClassificationSpec()
    )


def _code(path: Path, **kw: object) -> str:
    with pytest.raises(RejectedError) as info:
        _verify(path, **kw)  # type: ignore[arg-type]
    return info.value.code


def test_good_models_pass(tmp_path: Path) -> None:
    _verify(write_classifier(tmp_path / "c.onnx", input_size=64))
    _verify(write_detector(tmp_path / "d.onnx", input_size=64), post=DetectionSpec(format="yolov8"))
    _verify(write_classifier(tmp_path / "r.onnx", input_size=64), post=RawSpec())


def test_too_large(tmp_path: Path) -> None:
    model = write_classifier(tmp_path / "c.onnx", input_size=64)
    assert _code(model, max_bytes=model.stat().st_size - 1) == "too_large"


def test_truncated_and_garbage_are_bad_onnx(tmp_path: Path) -> None:
    model = write_classifier(tmp_path / "c.onnx", input_size=64)
    truncated = tmp_path / "t.onnx"
    truncated.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    assert _code(truncated) == "bad_onnx"
    garbage = tmp_path / "g.onnx"
    garbage.write_bytes(b"\x00" * 10)
    assert _code(garbage) == "bad_onnx"


def test_checker_failure(tmp_path: Path) -> None:
    assert _code(write_checker_failure(tmp_path / "b.onnx")) == "onnx_checker"


def test_incompatible_inputs_and_outputs(tmp_path: Path) -> None:
    model = write_classifier(tmp_path / "c.onnx", input_size=64)
    assert _code(model, pre=PreprocessSpec(width=224, height=224)) == "incompatible"
    assert _code(model, pre=PreprocessSpec(width=64, height=64, layout="nhwc")) == "incompatible"
    assert _code(model, pre=PreprocessSpec(width=64, height=64, input_name="pixels")) == "incompatible"
    # A classifier's [batch, 10] output cannot feed a YOLO decoder.
    assert _code(model, post=DetectionSpec(format="yolov8")) == "incompatible"
