"""What postprocessing produces for one frame: classes, detections or raw tensors."""

from __future__ import annotations

from pydantic import Field

from agent.model_base import StrictModel


class ClassScore(StrictModel):
    """One class of a classification result."""

    index: int = Field(ge=0)
    label: str
    score: float


class Detection(StrictModel):
    """One detected object; ``box`` is ``[x1, y1, x2, y2]`` in source-frame pixels."""

    index: int = Field(ge=0)
    label: str
    score: float
    box: tuple[float, float, float, float]


class RawTensor(StrictModel):
    """One output tensor, flattened and possibly truncated (``truncated`` says so)."""

    name: str
    shape: list[int]
    values: list[float]
    truncated: bool = False


class Prediction(StrictModel):
    """Everything postprocessing says about one frame; exactly one field is set per slot type."""

    classes: list[ClassScore] | None = None
    detections: list[Detection] | None = None
    tensors: list[RawTensor] | None = None
