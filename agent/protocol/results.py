"""What postprocessing produces for one frame: classes, detections or raw tensors."""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator, Field

from agent.model_base import StrictModel


def _null_is_nan(value: object) -> object:
    return float("nan") if value is None else value


#: A score; JSON has no NaN, so a NaN or infinite score is sent as null and read back as NaN: what a
#: broken model produces must stay a valid message, or consumers drop exactly the results that show it.
Score = Annotated[float, BeforeValidator(_null_is_nan)]


class ClassScore(StrictModel):
    """One class of a classification result."""

    index: int = Field(ge=0)
    label: str
    score: Score


class Detection(StrictModel):
    """One detected object; ``box`` is ``[x1, y1, x2, y2]`` in source-frame pixels."""

    index: int = Field(ge=0)
    label: str
    score: Score
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
