"""Shared helpers of the postprocess tests."""

from __future__ import annotations

import pytest

from agent.camera.preprocess import Letterbox


@pytest.fixture
def identity_lb() -> Letterbox:
    """Model pixels are frame pixels (a 640x640 frame fed to a 640x640 model)."""
    return Letterbox(1.0, 1.0, 0.0, 0.0, 640, 640)
