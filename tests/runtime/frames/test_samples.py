"""The sampler's decisions and bounds: which frames are samples, the rate, the queue, the JPEG budget."""

from __future__ import annotations

import base64
import re
import threading
from pathlib import Path

import cv2
import numpy as np
import pytest

from agent.camera.jpeg import SnapshotTooLargeError
from agent.config.changes import ConfigChange, needs_restart
from agent.config.models import SamplesConfig, SlotConfig
from agent.protocol.messages import decode, encode
from agent.protocol.results import ClassScore, Detection, Prediction
from agent.protocol.samples import SampleMessage
from agent.runtime.frames.samples import SamplePublisher, Sampler, sample_reason
from agent.telemetry.metrics import Metrics
from tests.sample_results import result


def _classes(*scores: float) -> Prediction:
    return Prediction(classes=[ClassScore(index=i, label=f"c{i}", score=s) for i, s in enumerate(scores)])


def _boxes(*scores: float) -> Prediction:
    return Prediction(
        detections=[
            Detection(index=i, label=f"d{i}", score=s, box=(10, 10, 50, 60)) for i, s in enumerate(scores)
        ]
    )


def _image() -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(0, 255, size=(480, 640, 3), dtype=np.uint8)


def test_sampling_is_off_unless_the_operator_turns_it_on() -> None:
    assert SlotConfig(model="m.onnx").samples.enabled is False
    sampler = Sampler(SamplesConfig(), "s")
    assert sampler.offer(_image(), result(_classes(0.1, 0.05), 1)) is False
    assert sampler.pending() == 0


@pytest.mark.parametrize(
    ("prediction", "reason"),
    [
        (_classes(0.3, 0.2), "low_confidence"),
        (_classes(0.9, 0.05), None),
        (_classes(float("nan"), 0.1), "unusual"),
        (_boxes(0.9, 0.4), "low_confidence"),
        (_boxes(0.9, 0.95), None),
        (_boxes(0.9, float("nan")), "unusual"),
        (_boxes(*([0.9] * 4)), "unusual"),
        (_boxes(), None),
    ],
)
def test_which_frames_are_samples(prediction: Prediction, reason: str | None) -> None:
    config = SamplesConfig(enabled=True, max_confidence=0.5, max_detections=3)
    assert sample_reason(prediction.classes, prediction.detections, config) == reason


def test_rate_is_a_sliding_minute_and_the_queue_is_bounded() -> None:
    now = [0.0]
    sampler = Sampler(SamplesConfig(enabled=True, per_minute=2), "s", clock=lambda: now[0])
    low = _classes(0.2)
    assert sampler.offer(_image(), result(low, 1))
    assert sampler.offer(_image(), result(low, 2))
    assert not sampler.offer(_image(), result(low, 3))  # third in the same minute
    assert sampler.skipped == 1
    now[0] = 59.9
    assert not sampler.offer(_image(), result(low, 4))
    now[0] = 60.0
    assert sampler.offer(_image(), result(low, 5))
    # The queue holds at most 4 frames however long the publisher stalls.
    for minute in range(2, 10):
        now[0] = 60.0 * minute
        sampler.offer(_image(), result(low, 10 + minute))
    assert sampler.pending() == 4


def test_a_taken_sample_is_a_bounded_jpeg_with_its_prediction() -> None:
    sampler = Sampler(SamplesConfig(enabled=True, max_bytes=8192, max_dimension=320), "slot-a")
    assert sampler.offer(_image(), result(_boxes(0.3, *([0.9] * 30)), 42))
    message = sampler.take(payload_limit=256 * 1024)
    assert message is not None
    assert sampler.take(256 * 1024) is None
    again = decode(SampleMessage, encode(message))
    assert again == message
    jpeg = base64.b64decode(again.jpeg_b64)
    assert len(jpeg) <= 8192
    image = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)
    assert image is not None
    assert max(image.shape[:2]) <= 320
    assert (again.width, again.height) == (image.shape[1], image.shape[0])
    assert (again.source_width, again.source_height) == (640, 480)
    assert again.frame == 42
    assert again.slot == "slot-a"
    assert again.reason == "low_confidence"
    assert again.prediction.detections is not None
    assert len(again.prediction.detections) == 20
    assert again.detections_total == 31


def test_the_payload_limit_caps_the_jpeg_below_max_bytes() -> None:
    sampler = Sampler(SamplesConfig(enabled=True, max_bytes=512 * 1024), "s")
    sampler.offer(_image(), result(_classes(0.1), 1))
    message = sampler.take(payload_limit=40 * 1024)
    assert message is not None
    assert len(encode(message)) <= 40 * 1024
    sampler.offer(_image(), result(_classes(0.1), 2))
    with pytest.raises(SnapshotTooLargeError):
        sampler.take(payload_limit=8 * 1024)  # no room left for any JPEG


def test_the_publisher_counts_what_it_sends_and_drops_what_cannot_fit() -> None:
    sent: list[SampleMessage] = []
    limit = [256 * 1024]
    sampler = Sampler(SamplesConfig(enabled=True, per_minute=10), "s")
    metrics = Metrics()
    publisher = SamplePublisher([sampler], sent.append, lambda: limit[0], threading.Event())
    metrics.add_collector(publisher.stats, prefix="samples")
    sampler.offer(_image(), result(_classes(0.1), 1))
    publisher.drain()
    limit[0] = 8 * 1024  # no room for any JPEG: dropped, not retried
    sampler.offer(_image(), result(_classes(0.1), 2))
    publisher.drain()
    assert [m.frame for m in sent] == [1]
    snapshot = metrics.snapshot()
    assert (snapshot["samples.published"], snapshot["samples.dropped"]) == (1.0, 1.0)
    assert sampler.pending() == 0


def test_the_protocol_doc_example_is_what_a_sampler_sends() -> None:
    doc = (Path(__file__).resolve().parents[3] / "docs" / "protocol.md").read_text()
    section = doc.split("### SampleMessage\n", 1)[1].split("\n### ", 1)[0]
    (example,) = re.findall(r"```json\n(.*?)```", section, re.S)
    documented = decode(SampleMessage, example.encode())
    jpeg = cv2.imdecode(np.frombuffer(base64.b64decode(documented.jpeg_b64), np.uint8), cv2.IMREAD_COLOR)
    assert jpeg is not None
    assert jpeg.shape[:2] == (documented.height, documented.width)
    sampler = Sampler(SamplesConfig(enabled=True, max_dimension=16), "det")
    detection = Detection(index=0, label="person", score=0.41, box=(8, 6, 40, 44))
    sampler.offer(
        np.full((48, 64, 3), 90, np.uint8), result(Prediction(detections=[detection]), 1234, "dock", "det")
    )
    sent = sampler.take(256 * 1024)
    assert sent is not None
    assert sent.model_copy(update={"msg_id": documented.msg_id}) == documented


def test_changing_samples_waits_for_a_restart() -> None:
    change = ConfigChange("slots.cls.samples.enabled", False, True)
    assert needs_restart(change, {"cls"})
