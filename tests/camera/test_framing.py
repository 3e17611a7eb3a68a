"""A stream's framing (agent/camera/framing.py): the cut made on the camera's frame and then turned
equals turning the whole frame and cutting the region out of it, for every turn and odd sizes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from pydantic import ValidationError

from agent.camera.framing import Framing, framed, region_pixels
from agent.camera.source_spec import Region
from agent.config.models import StreamConfig

_TURNS = {
    90: lambda image: np.rot90(image, k=-1),
    180: lambda image: np.rot90(image, k=2),
    270: lambda image: np.rot90(image, k=1),
}
REGIONS = [
    None,
    Region(x=0.1, y=0.2, width=0.5, height=0.3),
    Region(x=0.9, y=0.0, width=0.1, height=1.0),
    Region(x=0.0, y=0.99, width=0.01, height=0.01),
    Region(x=0.0, y=0.0, width=1.0, height=1.0),
]


@pytest.mark.parametrize("size", [(48, 64), (1080, 1920), (7, 5), (1, 1)])
@pytest.mark.parametrize("rotate", [0, 90, 180, 270])
@pytest.mark.parametrize("roi", REGIONS)
def test_the_cut_then_turn_equals_turning_the_frame_and_cutting_its_region(
    size: tuple[int, int], rotate: int, roi: Region | None
) -> None:
    image = np.random.default_rng(sum(size) + rotate).integers(0, 256, (*size, 3), dtype=np.uint8)
    turned = _TURNS[rotate](image) if rotate else image  # numpy's own turn, not the code's cv2.rotate
    left, top, right, bottom = region_pixels(roi, turned.shape[1], turned.shape[0])

    got = framed(image, Framing(rotate, roi))

    assert got.flags.c_contiguous
    assert got.shape == (bottom - top, right - left, 3)
    assert np.array_equal(got, turned[top:bottom, left:right])
    assert got.shape[0] >= 1
    assert got.shape[1] >= 1


def test_no_framing_hands_the_frame_through_untouched() -> None:
    image = np.zeros((4, 6, 3), np.uint8)
    assert framed(image, Framing()) is image


def test_a_region_in_fractions_keeps_its_place_when_the_camera_comes_back_at_another_resolution() -> None:
    roi = Region(x=0.25, y=0.5, width=0.5, height=0.5)
    assert region_pixels(roi, 1920, 1080) == (480, 540, 1440, 1080)
    assert region_pixels(roi, 1280, 720) == (320, 360, 960, 720)


def test_a_region_outside_the_frame_or_a_turn_no_camera_makes_is_refused_naming_the_key() -> None:
    source = {"type": "synthetic"}
    with pytest.raises(ValidationError) as outside:
        StreamConfig.model_validate(
            {"source": source, "slot": "a", "roi": {"x": 0.6, "y": 0, "width": 0.5, "height": 1}}
        )
    with pytest.raises(ValidationError) as turn:
        StreamConfig.model_validate({"source": source, "slot": "a", "rotate": 45})
    assert "x + width = 1.1" in str(outside.value)
    assert "roi" in str(outside.value)
    assert "rotate" in str(turn.value)


def test_the_documented_per_camera_example_is_a_valid_stream() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text(encoding="utf-8")
    section = doc.split("## Per-camera settings", 1)[1].split("\n## ", 1)[0]
    block = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    (stream,) = yaml.safe_load(block)["streams"].values()

    config = StreamConfig.model_validate(stream)

    assert (config.fps_limit, config.rotate) == (5, 90)
    assert config.roi == Region(x=0.0, y=0.25, width=1.0, height=0.75)
