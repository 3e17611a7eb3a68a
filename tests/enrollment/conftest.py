"""Fixtures of the device's enrollment tests: the documented broker and a real controller with its desk."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.enrollment.enrollment_fleet import EnrollmentFleet, start_fleet


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[EnrollmentFleet]:
    made = start_fleet(tmp_path / "fleet")
    yield made
    made.stop()
