"""A full state disk in the middle of a job: the job ends FAILED disk_full, that status waits in memory
while neither the spool nor the broker can take it, and the job is retried when space returns.

Real tmpfs (filled to 0 bytes free), real spool, real MqttLink, a real mosquitto stopped and started.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.demo.broker import Broker
from agent.protocol.messages import JobState, JobStatus, decode
from tests.delivery.delivery_stack import SLOT, Harness, Keys
from tests.small_disk import SmallDisk, small_disk
from tests.waiting import patient, wait_until


@pytest.fixture
def state_disk(tmp_path: Path) -> Iterator[SmallDisk]:
    with small_disk(tmp_path / "state-disk", "4m") as disk:
        yield disk


def test_a_status_nothing_can_take_is_held_in_memory_and_the_job_retried_when_space_returns(
    private_broker: Broker, state_disk: SmallDisk, keys: Keys, model_v1: Path
) -> None:
    device = Harness(private_broker, state_disk.path / "state", keys, config={"disk_full_retry_s": 0.2})
    try:
        device.start()
        manifest = device.manifest(model_v1, job_id="job-held")
        gate = device.repo.gate["job-held"] = threading.Event()
        device.deploy(device.signed(manifest))
        assert device.repo.at_gate.wait(patient(10))  # downloaded, not yet VERIFYING
        wait_until(lambda: device.spool.count() == 0, 10, "QUEUED and DOWNLOADING to be acknowledged")

        state_disk.fill()
        private_broker.stop()
        wait_until(lambda: not device.link.connected, 10, "the link to notice the broker is gone")
        gate.set()  # VERIFYING cannot be recorded: the job ends FAILED disk_full, with nowhere to go
        wait_until(lambda: device.service.held_statuses() == 1, 10, "the FAILED status to be held")
        # The job's worker thread marks the slot after the job's last status: wait for that too.
        wait_until(
            lambda: device.service.describe()["waiting_for_space"] == {SLOT: "job-held"},
            10,
            "the slot to wait for space",
        )
        assert device.spool.count() == 0

        state_disk.free()  # the spool takes the held status at once; the retry waits for the link
        wait_until(lambda: device.service.held_statuses() == 0, 10, "the held status to be spooled")
        (spooled,) = device.spool.pending()
        failed = decode(JobStatus, spooled.payload)
        assert (failed.job_id, failed.state, failed.error_code) == ("job-held", JobState.FAILED, "disk_full")
        # The end the full disk refused to record is written now: a restart will not resume the job.
        wait_until(lambda: device.jobs_json()["slots"][SLOT]["state"] == "FAILED", 10, "the late record")
        assert device.jobs_json()["slots"][SLOT]["error_code"] == "disk_full"
        assert device.repo.fetched == ["job-held"]  # no retry while offline

        private_broker.restart()
        wait_until(lambda: device.spool.count() == 0, 15, "the spooled FAILED to be acknowledged")
        wait_until(lambda: (device.jobs_json() or {})["slots"][SLOT]["state"] == "ACTIVE", 15, "the retry")
    finally:
        device.close()
    assert device.repo.fetched == ["job-held", "job-held"]
    assert [r.sha256 for r in device.activations.requests] == [manifest.sha256]
    assert device.service.describe()["waiting_for_space"] == {}
