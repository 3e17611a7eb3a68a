"""How a slot interprets its model's outputs (the configuration half)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from agent.model_base import StrictModel


class ClassificationSpec(StrictModel):
    """Top-k classes from a ``[batch, classes]`` score output."""

    type: Literal["classification"] = "classification"
    top_k: int = Field(5, ge=1, le=1000, description="How many classes to report per frame.")
    labels: list[str] | None = Field(None, description="Class names by index.")
    labels_file: Path | None = Field(None, description="File with one class name per line.")
    softmax: Literal["auto", "always", "never"] = Field(
        "auto", description="auto: apply softmax unless the scores already sum to 1."
    )
    output_name: str | None = Field(None, description="Output to read; default: the first output.")


class DetectionSpec(StrictModel):
    """Boxes from YOLOv5 (``[b, n, 5+c]``) or YOLOv8 (``[b, 4+c, n]``) style outputs."""

    type: Literal["detection"] = "detection"
    format: Literal["yolov5", "yolov8"] = Field("yolov8", description="Output layout of the detector.")
    conf_threshold: float = Field(0.25, ge=0.0, le=1.0, description="Minimum confidence kept.")
    iou_threshold: float = Field(0.45, ge=0.0, le=1.0, description="Class-wise NMS IoU threshold.")
    max_detections: int = Field(100, ge=1, le=10000, description="Most boxes reported per frame.")
    labels: list[str] | None = Field(None, description="Class names by index.")
    labels_file: Path | None = Field(None, description="File with one class name per line.")
    output_name: str | None = Field(None, description="Output to read; default: the first output.")


class RawSpec(StrictModel):
    """Outputs as tensors, truncated to ``max_values`` numbers each."""

    type: Literal["raw"] = "raw"
    max_values: int = Field(64, ge=0, le=1_000_000, description="Numbers per tensor to publish.")


PostprocessSpec = Annotated[ClassificationSpec | DetectionSpec | RawSpec, Field(discriminator="type")]
