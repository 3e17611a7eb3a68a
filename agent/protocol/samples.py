"""The ``up/samples`` message: one frame kept for retraining, with the model's prediction of it.

A device publishes these only when the operator turned ``samples.enabled`` on for the slot
(:mod:`agent.runtime.frames.samples`); the controller keeps them in a bounded store
(:mod:`agent.fleet.samples.store`) and ``edge-agent fleet samples export`` writes them as a dataset.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from agent.model_base import StrictModel
from agent.protocol.messages import Count, FiniteTime
from agent.protocol.results import Prediction

#: Why a frame was kept.
SampleReason = Literal["low_confidence", "unusual"]

#: The longest base64 text a sample may carry (what a 1 MiB JPEG takes, the most ``max_bytes`` allows).
MAX_SAMPLE_B64 = 4 * ((1024 * 1024 + 2) // 3)


class SampleMessage(StrictModel):
    """One sample frame: the JPEG (base64), its size, and what the serving model said of it."""

    msg_id: str = Field(min_length=1, max_length=64)
    ts: FiniteTime
    slot: str = Field(min_length=1, max_length=64)
    stream: str = Field(min_length=1, max_length=64)
    model_id: str = Field(max_length=128)
    model_version: str | None = Field(None, max_length=128)
    frame: Count
    reason: SampleReason
    width: int = Field(ge=1, le=65535)
    height: int = Field(ge=1, le=65535)
    #: The source frame's size: the detection boxes are in its pixels.
    source_width: int = Field(ge=1, le=65535)
    source_height: int = Field(ge=1, le=65535)
    jpeg_b64: str = Field(min_length=4, max_length=MAX_SAMPLE_B64)
    #: The model's prediction, cut to the top 5 classes / 20 boxes by score.
    prediction: Prediction
    #: How many boxes the model reported when more than the 20 kept.
    detections_total: Count | None = None
