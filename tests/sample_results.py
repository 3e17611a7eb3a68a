"""Result messages as the pipeline publishes them, for the samples tests."""

from __future__ import annotations

from agent.protocol.messages import ModelRef, ResultMessage
from agent.protocol.results import Prediction


def result(prediction: Prediction, frame: int = 1, stream: str = "cam", slot: str = "s") -> ResultMessage:
    """The result message the pipeline publishes for a frame with ``prediction``."""
    return ResultMessage(
        stream=stream,
        frame_index=frame,
        captured_at=1_700_000_000.0 + frame,
        published_at=1_700_000_000.5 + frame,
        model=ModelRef(slot=slot, model_id="m", version="1", sha256="0" * 64),
        latency_ms={"total": 1.0},
        classes=prediction.classes,
        detections=prediction.detections,
    )
