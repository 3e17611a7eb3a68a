"""Sample messages for the store tests, made by the device's real sampler from a seeded frame."""

from __future__ import annotations

import numpy as np

from agent.config.models import SamplesConfig
from agent.protocol.results import ClassScore, Prediction
from agent.protocol.samples import SampleMessage
from agent.runtime.frames.samples import Sampler
from tests.sample_results import result


def made_sample(prediction: Prediction, frame: int = 1, slot: str = "s") -> SampleMessage:
    """The sample the sampler makes of a noise frame seeded by ``frame`` (160x120 JPEG)."""
    rng = np.random.default_rng(frame)
    image = rng.integers(0, 255, size=(240, 320, 3), dtype=np.uint8)
    sampler = Sampler(SamplesConfig(enabled=True, max_dimension=160, max_bytes=16 * 1024), slot)
    assert sampler.offer(image, result(prediction, frame, slot=slot))
    message = sampler.take(payload_limit=256 * 1024)
    assert message is not None
    return message


def low_class(label: str = "cat") -> Prediction:
    """A classifier's unsure prediction: a sample by ``max_confidence``."""
    return Prediction(
        classes=[ClassScore(index=0, label=label, score=0.3), ClassScore(index=1, label="dog", score=0.2)]
    )
