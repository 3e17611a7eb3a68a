"""The controller and the broker killed at every step of a rollout, over the fleet simulator.

Every rollout here asks for what operators ask for: a shadow run (``min_agreement`` 0.9) and a
probation (2 s: long enough for a fault to land inside it, short enough for CI), in three waves
(2, 3 and 5 of 10 devices), ``--max-failed 0``. After each fault the rollout must end as it would
have without it, and the invariants hold:

- a healthy rollout ends DONE with every device ACTIVE on the new model; an unhealthy one still
  aborts, and its rollback puts every touched device back on the old model;
- no device runs a job twice (the simulator's ledger journal counts QUEUED per job), none is
  skipped, each job has one terminal state;
- ``sends.resent`` is the number of devices whose desired state was published more than once, as
  the broker saw it (a probe on the broker; across a broker restart, the broker's own log).

The controller is a child process (``fleet controller --config``), SIGKILLed or SIGTERMed at:
a canary's probation (its device ends ACTIVE while no controller runs: the restarted one must read
its end *with* its figures, not count it unhealthy), the second and third waves' sends, a soak,
an abort's rollback. The broker is SIGKILLed while a second-wave device is in probation (its end
is published while the broker is down) and started again on its port, with and without persistence.
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.protocol.manifest import recover_job_id
from agent.protocol.messages import JobState
from tests.fleet.operator_side import unique_prefix
from tests.fleetsim.controller_rig import ControllerRig

# A real controller and simulated fleet per test, rollouts with shadow and probation: tens of seconds.
pytestmark = pytest.mark.slow

DEVICES = 10
WAVES = "2,50%,100%"  # 2, 3 and 5 devices
PROBATION_S = 2.0
TERMINAL = {s.value for s in JobState if s.terminal}


def _body(**extra: Any) -> dict[str, Any]:
    return {
        "rollout_id": "faults",
        "waves": WAVES,
        "max_failed": "0",
        "shadow": {"frames": 10, "min_agreement": 0.9},
        "probation_s": PROBATION_S,
        **extra,
    }


@pytest.fixture
def make_rig(tmp_path: Path) -> Iterator[Any]:
    rigs: list[ControllerRig] = []

    def make(**options: Any) -> ControllerRig:
        rig = ControllerRig(tmp_path, devices=DEVICES, prefix=unique_prefix(), **options)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.close()


def _waves(rig: ControllerRig) -> list[list[str]]:
    return [rig.ids[:2], rig.ids[2:5], rig.ids[5:]]


def _ended(devices: dict[str, Any], job_id: str, names: list[str]) -> bool:
    return all((devices[d]["jobs"].get(job_id) or [""])[-1] in TERMINAL for d in names)


def _check_runs(rig: ControllerRig, status: dict[str, Any]) -> dict[str, Any]:
    """No job ran twice on any device and each run has one terminal state; the devices' report."""
    devices = rig.fleet.wait_report_after(time.time())["devices"]
    for name, device in devices.items():
        assert all(runs == 1 for runs in device["runs"].values()), (name, device["jobs"])
        jobs = list(device["jobs"].items())  # in the order the device took them up
        for index, (job, states) in enumerate(jobs):
            ends = sum(s in TERMINAL for s in states)
            if index == len(jobs) - 1:
                assert ends == 1, (name, job, states)
                assert states[-1] in TERMINAL, (name, job, states)
            else:
                # A job a newer desired state replaced mid-way (a rollback's) may show no end here:
                # the device does not yet publish SUPERSEDED for it (a device-side gap, not the
                # controller's); it never shows two.
                assert ends <= 1, (name, job, states)
    return dict(devices)


def _check_done(rig: ControllerRig, status: dict[str, Any]) -> None:
    assert status["state"] == "DONE", (status["reason"], rig.log.read_text(errors="replace")[-4000:])
    assert status["devices"] == {"ACTIVE": DEVICES}
    devices = _check_runs(rig, status)
    job_id = status["job_id"]
    assert {name: d["runs"] for name, d in devices.items()} == {name: {job_id: 1} for name in rig.ids}
    assert {d["slots"]["main"] for d in devices.values()} == {"cls:2"}


def _resent(counts: Counter[str]) -> int:
    return sum(1 for n in counts.values() if n > 1)


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
@pytest.mark.parametrize("point", ["canary-probation", "wave-2-sent", "wave-3-sent", "soak"])
def test_a_healthy_rollout_ends_done_whenever_the_controller_is_stopped(
    make_rig: Any, point: str, signum: signal.Signals
) -> None:
    rig: ControllerRig = make_rig()
    waves = _waves(rig)
    started = rig.start(_body(soak_s=2.0 if point == "soak" else 0.0))
    job_id = started["job_id"]
    if point == "canary-probation":
        rig.wait_probe(
            lambda _m: any(d in waves[0] and s == "PROBATION" for d, s in rig.job_states(job_id)),
            "a canary in probation",
        )
        rig.signal_controller(signum)
        # The canaries end ACTIVE (shadow and probation passed) while no controller runs.
        rig.wait_devices(lambda d: _ended(d, job_id, waves[0]), "the canaries' ends")
    elif point in ("wave-2-sent", "wave-3-sent"):
        wave = waves[1 if point == "wave-2-sent" else 2]
        rig.wait_probe(
            lambda _m: set(wave) <= set(rig.desired(job_id)), f"{point}: the wave's desired states"
        )
        rig.signal_controller(signum)
    else:
        rig.wait_status("faults", lambda s: s["waves"][0]["state"] == "SOAKING", "the first soak")
        rig.signal_controller(signum)
    rig.spawn()
    status = rig.wait_final("faults")
    _check_done(rig, status)
    assert status["sends"] == {"devices": DEVICES, "resent": _resent(rig.desired(job_id))}
    if point != "soak":  # (a soak's devices have all ended: nothing to publish again)
        # The wave running at the stop was published again (its devices got the same job).
        assert status["sends"]["resent"] > 0


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_an_abort_stopped_during_its_rollback_still_rolls_every_canary_back(
    make_rig: Any, signum: signal.Signals
) -> None:
    rig: ControllerRig = make_rig(unhealthy=["1@0-0:nan_outputs"])  # the first canary: NaN in probation
    waves = _waves(rig)
    # The model the devices serve came from a rollout of this controller: the abort sends it back as
    # a desired state (a job that can be interrupted), not as the device's rollback command.
    # (No probation there: the unhealthy canary would fail it with its own model.)
    base = rig.start({"rollout_id": "base", "waves": "100%"}, old=True)
    assert rig.wait_final("base")["state"] == "DONE"
    started = rig.start(_body(rollback_on_abort=True))
    job_id = started["job_id"]
    rig.wait_probe(
        lambda ms: any(
            "/down/desired/" in m.topic and recover_job_id(m.payload) not in (None, job_id, base["job_id"])
            for m in ms
        ),
        "the rollback's first desired state",
    )
    rig.signal_controller(signum)
    rig.spawn()
    status = rig.wait_final("faults")
    assert status["state"] == "ABORTED"
    assert "gate trips: 0 failed + 1 rolled back + 0 unhealthy" in status["reason"]
    assert [w["state"] for w in status["waves"]] == ["TRIPPED", "CANCELLED", "CANCELLED"]
    devices = _check_runs(rig, status)
    assert {name for name, d in devices.items() if job_id in d["runs"]} == set(waves[0])
    assert {d["slots"]["main"] for d in devices.values()} == {"cls:1"}
    assert status["sends"] == {"devices": DEVICES, "resent": _resent(rig.desired(job_id))}


@pytest.mark.parametrize("persistence", [False, True], ids=["no-persistence", "persistence"])
def test_a_healthy_rollout_ends_done_when_the_broker_is_killed_mid_wave(
    make_rig: Any, persistence: bool
) -> None:
    rig: ControllerRig = make_rig(persistence=persistence)
    waves = _waves(rig)
    started = rig.start(_body())
    job_id = started["job_id"]
    in_probation: list[str] = []

    def second_wave_in_probation(_messages: object) -> bool:
        in_probation[:] = [d for d, s in rig.job_states(job_id) if d in waves[1] and s == "PROBATION"]
        return bool(in_probation)

    rig.wait_probe(second_wave_in_probation, "a second-wave device in probation")
    rig.broker.kill()
    # Its end (ACTIVE, with its figures) is published while no broker runs: spooled, replayed later.
    rig.wait_devices(lambda d: _ended(d, job_id, in_probation[:1]), "its end while the broker is down")
    rig.broker.restart(hard=True)
    status = rig.wait_final("faults")
    _check_done(rig, status)
    publishes = rig.broker_publishes()
    assert set(publishes) == set(rig.ids)
    assert status["sends"] == {"devices": DEVICES, "resent": _resent(publishes)}
    # The wave's deploy published its desired states again once it was back (without persistence
    # the broker had lost them).
    assert status["sends"]["resent"] > 0
