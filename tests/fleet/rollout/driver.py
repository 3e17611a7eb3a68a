"""A minimal controller loop over a real :class:`RolloutStore`, run as a child process to be killed.

``python -m tests.fleet.rollout.driver STORE PUBLOG DEVICES`` creates rollout ``r1`` (if the store, a
SQLite file or a postgresql:// URL, has none) over DEVICES devices in waves ``5,10%,100%``, then
drives it to the end the way the controller will: per device ``mark_sending`` -> *publish* ->
``mark_sent``; then the device's job ends ACTIVE; then the wave ends. "Publish" appends
``device job_id`` to PUBLOG and fsyncs it (it stands in for the retained desired state on the
broker, which survives the controller). A line on stdout follows every committed transition, so
the parent knows what the store must hold when it kills the child.
No MQTT here on purpose: this drives the store's transitions and resume query, not the delivery.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from agent.fleet.rollout.gate import DeviceEnd
from agent.fleet.rollout.records import RolloutPlan, RolloutState, WaveState
from agent.fleet.rollout.waves import parse_waves, split_waves
from tests.fleet.store_sites import open_store


def _publish(log: Path, device: str, job_id: str) -> None:
    with log.open("a") as handle:
        handle.write(f"{device} {job_id}\n")
        handle.flush()
        os.fsync(handle.fileno())


def drive(db: str, log: Path, count: int) -> None:
    """Create ``r1`` unless it exists, then run it to DONE, resuming from whatever the store holds."""
    store = open_store(db)
    if not store.open_rollouts() and not store.events("r1"):
        devices = [f"jet-{index:04d}" for index in range(count)]
        plan = RolloutPlan("r1", "main", "job-r1", "5", split_waves(devices, parse_waves("5,10%,100%")))
        store.create(plan)
    for rollout_id in store.open_rollouts():
        while True:
            point = store.resume(rollout_id)
            if point.wave is None:
                waiting = [
                    i for i, (state, _, _) in enumerate(store.waves(rollout_id)) if state is WaveState.WAITING
                ]
                if not waiting:
                    store.set_state(rollout_id, RolloutState.DONE, "every wave held")
                    print("done", flush=True)
                    break
                store.set_wave(rollout_id, waiting[0], WaveState.RUNNING)
                continue
            for device in (*point.resend, *point.to_send):
                job_id = store.mark_sending(rollout_id, device)
                print(f"sending {device}", flush=True)
                _publish(log, device, job_id)
                store.mark_sent(rollout_id, device)
                print(f"sent {device}", flush=True)
            for device in store.resume(rollout_id).waiting:
                store.record_job(rollout_id, device, DeviceEnd.ACTIVE, {"shadow": None})
                print(f"ended {device}", flush=True)
            store.set_wave(rollout_id, point.wave, WaveState.DONE, figures={"failed": 0}, reason="gate holds")
            print(f"wave {point.wave}", flush=True)
    store.close()


if __name__ == "__main__":
    drive(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]))
