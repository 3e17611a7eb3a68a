"""A controller that runs for months keeps the CRL current by itself: an expired CRL makes the
broker refuse every device, so the desk re-issues it once half its life is gone (real controller)."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.demo.broker import Broker
from agent.fleet.ca.crl import read_crl
from agent.fleet.ca.layout import CaDir
from tests.fleet.enrollment.enroll_rig import EnrollRig, running_rig
from tests.waiting import wait_until


@pytest.fixture
def rig(tmp_path: Path, broker: Broker) -> Iterator[EnrollRig]:
    yield from running_rig(tmp_path, broker, "crl_check_s: 0.2")


def test_the_desk_reissues_a_crl_that_is_due_without_a_restart(rig: EnrollRig) -> None:
    crl = CaDir(rig.ca.ca.path).crl
    first = read_crl(crl)
    assert first is not None
    crl.unlink()  # missing counts as due, as does one past half its life

    wait_until(lambda: read_crl(crl) is not None, what="the CRL re-issued by the running controller")

    again = read_crl(crl)
    assert again is not None
    assert again.next_update_utc is not None
    assert again.next_update_utc > datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=30)
    assert rig.controller.child is not None
    assert rig.controller.child.poll() is None  # it kept running
