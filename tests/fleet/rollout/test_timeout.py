"""A wave's timeout with ``on_timeout: wait`` across a controller restart (agent/fleet/rollout/runner.py):
who had not started when the wave timed out is logged in the store, so a new runner does not take
a device that started late for one stuck in its job at the timeout.

A real mosquitto and a real store file; the device is a Probe publishing the job states an agent
would (a stand-in for a simulated fleet's device); the runners' clock is moved past the timeout.
"""

from __future__ import annotations

import time
from pathlib import Path

from agent.demo.broker import Broker
from agent.fleet.rollout.records import RolloutState
from agent.fleet.rollout.runner import RolloutRunner
from agent.fleet.rollout.spec import RolloutRequest
from agent.fsutil import sha256_file
from agent.protocol.messages import JobState, JobStatus, ProbationFigures, ShadowFigures, encode
from agent.protocol.proving import ShadowSpec
from agent.protocol.topics import Topics
from tests.fleet.operator_side import announce, operator_settings, tiny_model, unique_prefix
from tests.fleet.store_sites import StoreSite
from tests.mqtt_probe import Probe
from tests.waiting import wait_until

SLOT = "cls"


def test_a_device_that_started_after_the_timeout_is_still_waited_for_after_a_restart(
    tmp_path: Path, broker: Broker, store_site: StoreSite
) -> None:
    prefix = unique_prefix()
    settings = operator_settings(broker, prefix)
    model = tiny_model(tmp_path / "m.onnx")
    request = RolloutRequest(
        model_sha256=sha256_file(model),
        model_name=model.name,
        slot=SLOT,
        version="2",
        devices=["r0"],
        wave_timeout_s=60.0,
        on_timeout="wait",
        max_failed="0",
        shadow=ShadowSpec(frames=30, min_agreement=0.9),
        probation_s=5.0,
    )
    store = store_site.open()
    store.create(request.plan("late", "job-late", 42, {}, {}))
    ahead = [0.0]  # how far the runners' clock is ahead of the store's

    def runner() -> RolloutRunner:
        return RolloutRunner(
            store,
            "late",
            settings=settings,
            model_path=lambda _sha: model,
            signing_key=None,
            key_id=None,
            deploy_options={"serve": False, "wait_unknown": True, "status_poll_s": 1.0},
            clock=lambda: time.time() + ahead[0],
        )

    jobs = Topics(prefix, "r0").jobs("job-late")

    def job(
        state: JobState, shadow: ShadowFigures | None = None, probation: ProbationFigures | None = None
    ) -> None:
        status = JobStatus(job_id="job-late", slot=SLOT, state=state, shadow=shadow, probation=probation)
        device.publish(jobs, encode(status))

    first = runner()
    with Probe(broker.host, broker.port) as device:
        announce(device, prefix, "r0")
        try:
            assert first.step() is False  # the wave starts: r0's desired state is published
            ahead[0] = 120.0  # the wave's 60 s are over; r0 has not started
            assert first.step() is False
            timeouts = [d for what, d in store.events("late") if what == "timeout"]
            assert timeouts == [{"wave": 0, "not_started": ["r0"]}]
            job(JobState.QUEUED)  # r0 starts, after the timeout
            wait_until(
                lambda: first.step() or (store.devices("late")[0].figures or {}).get("state") == "QUEUED",
                timeout=30,
                what="r0's QUEUED stored",
            )
            assert store.rollout("late").state is RolloutState.RUNNING
        finally:
            first.stop()
        # A restarted controller: the store says r0 had started (QUEUED); the log says it started late.
        second = runner()
        try:
            assert second.step() is False
            assert store.rollout("late").state is RolloutState.RUNNING, store.rollout("late").reason
            job(
                JobState.ACTIVE,
                shadow=ShadowFigures(frames=30, agreement=0.97, latency_ratio=1.0),
                probation=ProbationFigures(elapsed_s=5.0, probation_s=5.0),
            )
            wait_until(
                lambda: second.step() or store.rollout("late").state is not RolloutState.RUNNING,
                timeout=30,
                what="the rollout ends",
            )
        finally:
            second.stop()
    final = store.rollout("late")
    ends = [(r.device, r.end.value if r.end else None) for r in store.devices("late")]
    logged = [d for what, d in store.events("late") if what == "timeout"]
    store.close()
    assert final.state is RolloutState.DONE, final.reason
    assert ends == [("r0", "ACTIVE")]  # one end, no TIMED_OUT before it
    assert logged == timeouts  # logged once, read back by the second runner
