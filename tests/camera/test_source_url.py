"""URL sources against a real HTTP MJPEG server on loopback (read through the wheel's FFmpeg)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml

from agent.camera.drivers.url import redact
from agent.camera.source import SourceState
from agent.camera.source_spec import UrlSourceSpec
from tests.camera.mjpeg_server import MjpegServer
from tests.camera.recorder import Recorder
from tests.camera.specs import make

S = SourceState


@pytest.fixture
def camera() -> Iterator[MjpegServer]:
    server = MjpegServer().start()
    yield server
    server.stop()


def test_stream_survives_the_camera_going_away_and_coming_back(camera: MjpegServer) -> None:
    spec = make(UrlSourceSpec, url=camera.url, reconnect_min_s=0.1, reconnect_max_s=0.3)
    rec = Recorder("ipcam", spec).start()
    rec.wait_until("first frames", lambda: rec.frame_count() >= 5)
    assert rec.source.state is S.STREAMING
    assert rec.source.is_live

    camera.stop()
    rec.wait_until("the loss to be noticed", lambda: rec.count(S.RECONNECTING) >= 1)
    before_restart = rec.frame_count()

    camera.start()  # same port
    rec.wait_until("streaming again", lambda: rec.count(S.STREAMING) >= 2)
    rec.wait_until("frames after the reconnect", lambda: rec.frame_count() >= before_restart + 3)
    rec.stop()

    indices = [f.index for f in rec.frames]
    assert indices == list(range(len(indices)))  # the index continues across the reconnect
    for f in rec.frames:
        assert f.image.shape == (48, 64, 3)
        assert f.image.dtype == np.uint8
    seen = rec.transitions()
    assert seen[:3] == [(S.IDLE, S.CONNECTING), (S.CONNECTING, S.STREAMING), (S.STREAMING, S.RECONNECTING)]
    assert (S.RECONNECTING, S.CONNECTING) in seen
    assert seen[-1][1] is S.STOPPED
    assert all(e.reason for e in rec.events)
    assert rec.source.stats()["reconnects"] >= 1


def test_unreachable_url_is_retried(camera: MjpegServer) -> None:
    camera.stop()  # nothing listens on this port any more
    spec = make(UrlSourceSpec, url=camera.url, reconnect_min_s=0.05, reconnect_max_s=0.1)
    rec = Recorder("ipcam", spec).start()
    rec.wait_until("two reconnects", lambda: rec.count(S.RECONNECTING) >= 2)
    rec.stop()
    assert "cannot open camera stream" in next(e.reason for e in rec.events if e.new is S.RECONNECTING)
    assert rec.frames == []


def test_unsupported_scheme_is_reported() -> None:
    spec = make(UrlSourceSpec, url="ftp://cam/stream", reconnect_min_s=0.05, reconnect_max_s=0.1)
    rec = Recorder("ipcam", spec).start()
    rec.wait_until("a reconnect", lambda: rec.count(S.RECONNECTING) >= 1)
    rec.stop()
    assert "must start with rtsp://" in next(e.reason for e in rec.events if e.new is S.RECONNECTING)


def test_credentials_are_redacted() -> None:
    assert redact("rtsp://admin:secret@10.0.0.5:554/live") == "rtsp://***@10.0.0.5:554/live"
    assert redact("http://10.0.0.5/mjpg") == "http://10.0.0.5/mjpg"


def test_the_documented_url_source_is_accepted_with_its_defaults() -> None:
    text = (Path(__file__).parents[2] / "docs" / "cameras.md").read_text()
    section = text.split("## `url`: a network camera", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block is not None
    spec = UrlSourceSpec.model_validate(yaml.safe_load(block.group(1))["source"])
    defaults = make(UrlSourceSpec, url=spec.url)
    assert (spec.open_timeout_s, spec.read_timeout_s) == (defaults.open_timeout_s, defaults.read_timeout_s)
    assert spec.decode_threads == defaults.decode_threads
