"""How a slot turns a camera frame into the model's input tensor (the configuration half)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from agent.model_base import StrictModel


class PreprocessSpec(StrictModel):
    """Resize, colour order, normalisation, layout and dtype of a model input."""

    width: int = Field(224, gt=0, le=8192, description="Model input width in pixels.")
    height: int = Field(224, gt=0, le=8192, description="Model input height in pixels.")
    resize: Literal["stretch", "letterbox"] = Field(
        "stretch", description="stretch: scale to size ignoring aspect; letterbox: keep aspect, pad."
    )
    pad_value: int = Field(114, ge=0, le=255, description="Grey level of letterbox padding.")
    color: Literal["rgb", "bgr"] = Field("rgb", description="Channel order the model expects.")
    layout: Literal["nchw", "nhwc"] = Field("nchw", description="Tensor layout the model expects.")
    dtype: Literal["float32", "float16", "uint8"] = Field("float32", description="Input element type.")
    scale: float = Field(1.0 / 255.0, description="Multiplier applied to 0..255 pixel values first.")
    mean: tuple[float, float, float] = Field(
        (0.0, 0.0, 0.0), description="Subtracted per channel after scale."
    )
    std: tuple[float, float, float] = Field((1.0, 1.0, 1.0), description="Divisor per channel after mean.")
    input_name: str | None = Field(None, description="Model input to feed; default: the first input.")
