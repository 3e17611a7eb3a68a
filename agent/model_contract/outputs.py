"""Can a model's outputs feed a postprocess? Checked on the output specs, before any frame is run."""

from __future__ import annotations

from collections.abc import Sequence

import structlog

from agent.errors import EngineError
from agent.model_contract.tensors import TensorSpec, describe_shape, pick_output_spec
from agent.specs.postprocess import ClassificationSpec, DetectionSpec, PostprocessSpec

log = structlog.get_logger(__name__)

#: Fewest values per box: 4 coordinates + 1 class (+ objectness for YOLOv5).
MIN_CHANNELS = {"yolov8": 5, "yolov5": 6}


def validate_outputs(spec: PostprocessSpec, outputs: Sequence[TensorSpec]) -> None:
    """Raise :class:`~agent.errors.EngineError` when a model's outputs cannot feed ``spec``.

    Called when a model is loaded, so an incompatible model is refused before it goes live.
    """
    if isinstance(spec, ClassificationSpec):
        validate_classification(spec, outputs)
    elif isinstance(spec, DetectionSpec):
        validate_detection(spec, outputs)


def validate_classification(spec: ClassificationSpec, outputs: Sequence[TensorSpec]) -> None:
    """Refuse a model whose output is not one score per class (``[batch, c]``, ``[batch, c, 1, 1]``)."""
    out = pick_output_spec(outputs, spec.output_name)
    item_dims = out.shape[1:]
    # Symbolic or unknown dims may be > 1, so they count as class axes.
    class_axes = [d for d in item_dims if d != 1]
    if not item_dims or len(class_axes) > 1:
        raise EngineError(
            f"classification needs an output of shape [batch, classes]; {out.name!r} is "
            f"{describe_shape(out)}; use postprocess type 'detection' or 'raw' for this model"
        )


def validate_detection(spec: DetectionSpec, outputs: Sequence[TensorSpec]) -> None:
    """Refuse a model whose output cannot be a ``[batch, 4+c, n]`` / ``[batch, n, 5+c]`` detector."""
    out = pick_output_spec(outputs, spec.output_name)
    expected = "[batch, 4+classes, boxes]" if spec.format == "yolov8" else "[batch, boxes, 5+classes]"
    if len(out.shape) != 3:
        raise EngineError(
            f"{spec.format} detection needs an output of shape {expected}; {out.name!r} is "
            f"{describe_shape(out)}; check postprocess.type and postprocess.output_name"
        )
    channels, boxes = (
        (out.shape[1], out.shape[2]) if spec.format == "yolov8" else (out.shape[2], out.shape[1])
    )
    minimum = MIN_CHANNELS[spec.format]
    if isinstance(channels, int) and 0 < channels < minimum:
        raise EngineError(
            f"{spec.format} detection needs at least {minimum} values per box; {out.name!r} is "
            f"{describe_shape(out)}; check postprocess.format"
        )
    if isinstance(channels, int) and isinstance(boxes, int) and channels > boxes > 0:
        # Real detectors have far more boxes than values per box: this is probably the other layout.
        log.warning(
            "postprocess.detection.layout_suspect", output=out.name, shape=list(out.shape), format=spec.format
        )
