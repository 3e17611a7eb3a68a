"""The ``snapshot`` command's bounds: a huge frame, a tiny byte budget, a flood, the MQTT limit;
and the board that pairs a frame with the result published for it."""

from __future__ import annotations

import base64
from typing import Any

import cv2
import numpy as np
import numpy.typing as npt
import pytest

from agent.camera.jpeg import SnapshotTooLargeError, encode_jpeg
from agent.config.models import SnapshotConfig
from agent.protocol.command_args import SnapshotArgs
from agent.protocol.messages import ModelRef, ResultMessage
from agent.protocol.results import ClassScore
from agent.runtime.frames.snapshot_command import (
    NoFrameError,
    RateLimitedError,
    SnapshotCommand,
    WrongStreamError,
)
from agent.runtime.frames.snapshots import Snapshot, SnapshotBoard


def _noise(height: int, width: int, seed: int = 3) -> npt.NDArray[Any]:
    # Noise is what JPEG compresses worst: the byte budget really has to bite.
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _result(index: int, stream: str = "cam") -> ResultMessage:
    return ResultMessage(
        stream=stream,
        frame_index=index,
        captured_at=1_700_000_000.0 + index,
        published_at=1_700_000_000.5 + index,
        model=ModelRef(slot="cls", model_id="m", version="1", sha256="ab" * 32),
        latency_ms={"total": 1.0},
        classes=[ClassScore(index=1, label=f"label-{index}", score=0.9)],
    )


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _command(
    image: npt.NDArray[np.uint8], *, limit: int = 256 * 1024, clock: _Clock | None = None, **config: Any
) -> SnapshotCommand:
    board = SnapshotBoard()
    board.inferred("cam", 7, image)
    board.published(_result(7))
    return SnapshotCommand(
        SnapshotConfig(**config), ["cam", "side"], board.latest, lambda: limit, clock=clock or _Clock()
    )


def _decoded(reply: dict[str, Any]) -> npt.NDArray[Any]:
    jpeg = base64.b64decode(reply["jpeg_base64"])
    assert len(jpeg) == reply["bytes"]
    image = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)
    assert image is not None
    return image


def test_a_huge_frame_is_scaled_to_the_bound_and_fits() -> None:
    huge = np.zeros((4320, 7680, 3), np.uint8)  # 8K
    huge[:, 3840:] = (0, 0, 255)
    reply = _command(huge, max_dimension=640, max_bytes=50_000)(SnapshotArgs())
    image = _decoded(reply)
    assert image.shape == (360, 640, 3)
    assert (reply["source_width"], reply["source_height"]) == (7680, 4320)
    assert reply["bytes"] <= 50_000
    # The right half is still red, the left black: the frame, not something else, was scaled.
    assert image[:, 330:, 2].mean() > 200
    assert image[:, :310].mean() < 20


def test_a_tiny_byte_budget_lowers_quality_then_size() -> None:
    frame = _noise(480, 640)
    roomy = _command(frame, limit=4 * 1024 * 1024, max_bytes=2 * 1024 * 1024)(SnapshotArgs())
    assert (roomy["width"], roomy["quality"]) == (640, 85)
    tight = _command(frame, max_bytes=1024)(SnapshotArgs())
    assert tight["bytes"] <= 1024
    assert tight["quality"] < 85
    assert tight["width"] < 640
    assert tight["width"] / tight["height"] == pytest.approx(640 / 480, rel=0.1)
    _decoded(tight)


def test_the_mqtt_payload_limit_bounds_the_jpeg_too() -> None:
    frame = _noise(480, 640)
    reply = _command(frame, limit=20_000, max_bytes=1024 * 1024)(SnapshotArgs())
    assert reply["bytes"] <= (20_000 - 512) * 3 // 4
    with pytest.raises(SnapshotTooLargeError, match=r"mqtt\.max_payload_bytes"):
        _command(frame, limit=600)(SnapshotArgs())


def test_a_budget_no_jpeg_fits_is_refused_by_name() -> None:
    with pytest.raises(SnapshotTooLargeError, match=r"snapshot\.max_bytes"):
        encode_jpeg(_noise(64, 64), 64, 100, 85)


def test_a_flood_is_rate_limited_per_minute() -> None:
    clock = _Clock()
    command = _command(_noise(48, 64), clock=clock, per_minute=3)
    for _ in range(3):
        command(SnapshotArgs())
    for _ in range(20):
        with pytest.raises(RateLimitedError, match="retry in 60 s"):
            command(SnapshotArgs())
    clock.now += 59.0
    with pytest.raises(RateLimitedError):
        command(SnapshotArgs())
    clock.now += 1.0  # the first three leave the window; refusals counted nothing
    for _ in range(3):
        command(SnapshotArgs())
    with pytest.raises(RateLimitedError):
        command(SnapshotArgs())


def test_off_wrong_stream_and_no_frame_yet() -> None:
    with pytest.raises(RateLimitedError, match="per_minute: 0"):
        _command(_noise(8, 8), per_minute=0)(SnapshotArgs())
    command = _command(_noise(48, 64))
    with pytest.raises(WrongStreamError, match="cam, side"):
        command(SnapshotArgs(stream="back"))
    with pytest.raises(NoFrameError, match="'side'"):
        command(SnapshotArgs(stream="side"))


def test_a_request_may_ask_for_less_never_more() -> None:
    frame = _noise(480, 640)
    assert _command(frame, max_dimension=320)(SnapshotArgs(max_dimension=100))["width"] == 100
    assert _command(frame, max_dimension=320)(SnapshotArgs(max_dimension=4000))["width"] == 320


def test_the_board_pairs_each_frame_with_its_own_result_only() -> None:
    board = SnapshotBoard()
    first, second = _noise(4, 4, 1), _noise(4, 4, 2)
    board.inferred("cam", 10, first)
    board.inferred("cam", 9, second)  # an older frame from a slower worker does not replace it
    board.published(_result(9))
    assert board.latest("cam") is None  # frame 9's image is not held: no pairing with frame 10's
    board.published(_result(10))
    latest = board.latest("cam")
    assert isinstance(latest, Snapshot)
    assert latest.image is first
    assert latest.result.frame_index == 10
    board.inferred("cam", 11, second)
    assert board.latest("cam") is latest  # until frame 11's result is out, frame 10 stays latest
    board.published(_result(11))
    latest = board.latest("cam")
    assert latest is not None
    assert latest.image is second
