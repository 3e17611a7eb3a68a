"""End to end: one build per engine key for the whole fleet, not one per device that misses it (issue 23.4).

Real mosquitto, the real fleet controller (engine store, build claims, signing with the operator's
key), real ``python -m agent run`` daemons of one fingerprint, real ONNX Runtime builds, shadow and
probation on. The controller's claims are tightened (quiet after 3 s, re-asks every second) so the
faults below play out in seconds; the rules are the defaults'.

- Three devices miss the same key at once: the first asker is told to build, the others are told
  who builds it and wait; exactly one builds, the others download, every job ACTIVE once.
- The claim holder is SIGKILLed mid-build (its build held back by :mod:`tests.engines.paced_build`):
  its claim goes quiet, a waiting device takes it and builds, the killed device comes back and
  downloads; the deployment finishes, each device's job ACTIVE exactly once.
- An "upgrade": every device's L4T release changes (a fake Jetson root through
  ``telemetry.sysfs_root``, as tests/machine/test_platform.py fakes the absent hardware), so every engine
  key changes. The first device back builds at start-up while its ONNX model serves, swaps the
  engine in through shadow and probation and offers it (its start-up job's ACTIVE status is the
  evidence); the next device back downloads it at start-up.
- The INT8 check rejects the claimed INT8 engine (calibrated on black frames): the device releases
  that key's claim as it falls back, so the next wave builds at once instead of waiting for it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import cv2
import numpy as np
import pytest

from agent.datasets.shapes import MODEL_PATH
from agent.demo.broker import Broker
from agent.fleet.engines.claims import ClaimBook
from agent.fleet.engines.hooks import engines_listing
from agent.fleet.engines.settings import EngineShareSettings
from agent.protocol.messages import JobState
from agent.protocol.topics import Topics
from agent.specs.build import BuildSpec, CalibrationSource
from tests.e2e.daemon import AgentFiles, Daemon
from tests.e2e.fleet_rig import Fleet, count_version, final_status, finish, job_statuses
from tests.e2e.test_fleet_engines import (
    PROBATION,
    SHADOW,
    effective_of,
    progress_lines,
    progress_lines_of,
)
from tests.engines import paced_build
from tests.fleet.controller.loop_thread import RunningController
from tests.machine.test_platform import AGX_RELEASE, jetson_root
from tests.mqtt_probe import Probe
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

FP32 = BuildSpec(precision="fp32", device="cpu")
GUARDED = {"build": FP32, "share_engines": True, "shadow": SHADOW, "probation_s": 2.0, "probation": PROBATION}


@pytest.fixture
def controller(tmp_path: Path, broker: Broker, fleet: Fleet) -> Iterator[RunningController]:
    running = RunningController(
        fleet.controller_config(
            tmp_path / "controller", engines=EngineShareSettings(claim_quiet_s=3.0, claim_retry_s=1.0)
        )
    )
    yield running
    running.stop()


def serving_v1(
    fleet: Fleet, probe: Probe, devices: list[str], **env: dict[str, str]
) -> dict[str, AgentFiles]:
    probe.subscribe("fleet/v1/+/up/#")
    files = {}
    for device in devices:
        files[device] = (
            fleet.start_shapes(device) if device not in env else _paced(fleet, device, env[device])
        )
    for device in devices:
        probe.wait_for(count_version("1", Topics("fleet/v1", device).results("cam")), timeout=180)
    return files


def _paced(fleet: Fleet, device: str, extra: dict[str, str]) -> AgentFiles:
    """``Fleet.start_shapes`` with its builds paced on a gate file (the test lets them go)."""
    files = fleet.start_shapes(device)
    (daemon,) = [d for d in fleet.daemons if d.log_path.parent == files.root]
    daemon.kill()
    fleet.daemons.remove(daemon)
    restart(fleet, files, extra)
    return files


def restart(fleet: Fleet, files: AgentFiles, env: dict[str, str] | None = None) -> Daemon:
    daemon = Daemon(files.config_path, files.root / f"agent-{len(fleet.daemons)}.log", env=env)
    fleet.daemons.append(daemon)
    return daemon


def actives(probe: Probe, job_id: str, device: str) -> int:
    """How many distinct ACTIVE statuses the device published for the job (a repeat has its msg_id).

    Counted once the probe has heard the job end: ``fleet deploy`` is another subscriber and may hear
    the ACTIVE first, so the probe's copy is waited for, never read as it stands."""
    final_status(probe, job_id, device)
    return len({s.msg_id for s in job_statuses(probe, job_id, device) if s.state is JobState.ACTIVE})


def origins(probe: Probe, job_id: str, devices: list[str]) -> Counter[str]:
    return Counter(effective_of(probe, job_id, d)["engine_source"]["origin"] for d in devices)


def test_three_devices_missing_the_same_engine_at_once_build_it_once(
    fleet: Fleet, controller: RunningController, probe: Probe, device_id: str
) -> None:
    devices = [f"{device_id}-{i}" for i in range(3)]
    files = serving_v1(fleet, probe, devices)
    deploy = fleet.deploy(MODEL_PATH, devices, "2", **GUARDED)
    outcome = finish(deploy, timeout=300.0)
    for device in devices:
        progress = outcome.devices[device]
        assert progress.state is JobState.ACTIVE, progress
        assert {JobState.SHADOW, JobState.PROBATION} <= set(progress.history)
        assert actives(probe, deploy.job_id, device) == 1
    assert origins(probe, deploy.job_id, devices) == Counter({"built": 1, "downloaded": 2})
    store = controller.controller.engines.store
    wait_until(lambda: len(store.entries()) == 1, timeout=60, what="the one engine stored")
    (builder,) = [
        d for d in devices if effective_of(probe, deploy.job_id, d)["engine_source"]["origin"] == "built"
    ]
    assert store.entries()[0].record.built_by == builder
    wait_until(lambda: store.entries()[0].reuse == 2, timeout=30, what="both downloads counted")
    for device in devices:
        if device != builder:
            lines = progress_lines(files[device])
            # Told who builds it (its ask came while the builder held the claim), or the engine was stored.
            assert any("downloaded engine" in line for line in lines), lines
    claims = controller.controller.engines.claims
    assert len(claims) == 0  # the claim ended when the engine was stored
    assert claims.stats["granted"] == 1


def test_a_claim_holder_killed_mid_build_hands_the_claim_on_and_every_job_ends_once(
    fleet: Fleet, controller: RunningController, probe: Probe, device_id: str, tmp_path: Path
) -> None:
    devices = [f"{device_id}-{i}" for i in range(3)]
    gates = {d: tmp_path / f"gate-{d}" for d in devices}
    files = serving_v1(fleet, probe, devices, **{d: paced_build.env(gates[d]) for d in devices})
    claims = controller.controller.engines.claims
    deploy = fleet.deploy(MODEL_PATH, devices, "2", **GUARDED)

    def holder() -> str | None:
        live = claims.live(0.0)
        return live[0].device if live else None

    wait_until(lambda: holder() is not None, timeout=120.0, what="a device told to build")
    first = holder()
    assert first is not None

    def building(device: str) -> bool:
        return any(line.startswith("calibrating 1/") for line in progress_lines(files[device]))

    wait_until(lambda: building(first), timeout=60.0, what=f"{first} building (held at its gate)")
    (daemon,) = [d for d in fleet.daemons if d.log_path.parent == files[first].root and d.proc.poll() is None]
    daemon.kill()  # SIGKILL: no release, no offline of its own; its claim goes quiet
    for device in devices:
        if device != first:
            gates[device].touch()
    wait_until(
        lambda: holder() not in (None, first) or len(controller.controller.engines.store.entries()) == 1,
        timeout=60.0,
        what="another device taking the quiet claim",
    )
    gates[first].touch()
    restart(fleet, files[first], paced_build.env(gates[first]))  # its job resumes from its ledger
    outcome = finish(deploy, timeout=300.0)
    for device in devices:
        progress = outcome.devices[device]
        assert progress.state is JobState.ACTIVE, progress
        assert actives(probe, deploy.job_id, device) == 1  # each job once
        statuses = {s.state for s in job_statuses(probe, deploy.job_id, device)}
        assert not statuses & {JobState.FAILED, JobState.ROLLED_BACK, JobState.REJECTED}, statuses
    counted = origins(probe, deploy.job_id, devices)
    assert counted == Counter({"built": 1, "downloaded": 2}), counted
    assert effective_of(probe, deploy.job_id, first)["engine_source"]["origin"] == "downloaded"
    assert claims.stats["expired"] >= 1
    assert any(device == first and "quiet" in why for _key, device, why in claims.ended)


def start_on_release(fleet: Fleet, device: str, revision: str) -> Daemon:
    """``Fleet.start_shapes``'s device on a Jetson of L4T R36 ``revision``: a fake root of its platform files
    (``telemetry.sysfs_root``; no Jetson here), short start-up shadow and probation bars."""
    root = fleet.root / device / f"jetson-{revision}"
    if not root.exists():
        root.mkdir(parents=True)
        jetson_root(root, release=AGX_RELEASE.replace("REVISION: 4.0", f"REVISION: {revision}"))
    files = fleet.shapes_files(
        device,
        realtime=False,
        telemetry={"sysfs_root": str(root), "interval_s": 1.0},
        engines={  # the bars of tests/e2e/test_fleet_engines.py: a loaded host is not a slow engine
            "startup_guard": {
                "shadow_frames": 10,
                "min_agreement": 0.8,
                "max_latency_ratio": 1000.0,
                "probation_s": 2.0,
                "min_fps_ratio": 0.1,
                "max_p99_ratio": 1000.0,
                "max_drop_increase": 0.9,
            }
        },
    )
    return fleet.start(files)


def logged(daemon: Daemon, text: str) -> bool:
    return any(text in line for line in progress_lines_of(daemon.log_path))


def test_after_an_upgrade_the_first_device_back_builds_at_start_up_and_the_next_downloads(
    fleet: Fleet, controller: RunningController, probe: Probe, device_id: str
) -> None:
    devices = [f"{device_id}-{i}" for i in range(2)]
    probe.subscribe("fleet/v1/+/up/#")
    daemons = {device: start_on_release(fleet, device, "3.0") for device in devices}
    for device in devices:
        probe.wait_for(count_version("1", Topics("fleet/v1", device).results("cam")), timeout=180)
    deploy = fleet.deploy(MODEL_PATH, devices, "2", **GUARDED)  # state.json: a sharing deployment's model
    outcome = finish(deploy, timeout=300.0)
    assert all(outcome.devices[d].state is JobState.ACTIVE for d in devices), outcome
    store = controller.controller.engines.store
    wait_until(lambda: len(store.entries()) == 1, timeout=60, what="the JetPack 6.0 engine stored")
    (before,) = store.entries()
    for device in devices:
        assert daemons[device].stop() == 0

    # The upgrade: L4T R36.4 on both, so the engine key of the model they serve is new.
    first, second = devices
    daemon = start_on_release(fleet, first, "4.0")
    wait_until(lambda: logged(daemon, "building here"), timeout=120.0, what=f"{first} told to build")
    wait_until(lambda: len(store.entries()) == 2, timeout=180.0, what="the upgraded engine offered")
    (after,) = [e for e in store.entries() if e.record.key != before.record.key]
    assert after.record.built_by == first
    assert after.record.job_id.startswith("startup-cls-")
    assert after.record.fingerprint == before.record.fingerprint.replace("L4T R36.3.0", "L4T R36.4.0")
    # The evidence the controller checked: the start-up job ACTIVE with shadow and probation figures.
    (active,) = {s.msg_id: s for s in job_statuses(probe, after.record.job_id, first)}.values()
    assert active.state is JobState.ACTIVE
    assert active.shadow is not None
    assert active.shadow.frames >= 1  # the shadow judges the frames it has (at most 10 here)
    assert active.probation is not None
    assert active.probation.probation_s == 2.0

    daemon = start_on_release(fleet, second, "4.0")
    wait_until(lambda: logged(daemon, "downloaded engine"), timeout=120.0, what=f"{second} downloading")
    assert not logged(daemon, "building here")

    def reused() -> int:
        entry = store.get(after.record.key)
        return entry.reuse if entry is not None else -1

    wait_until(lambda: reused() == 1, timeout=30, what="the download counted")
    probe.clear()
    probe.wait_for(count_version("2", Topics("fleet/v1", second).results("cam")), timeout=60)


def black_images(directory: Path, count: int = 16) -> Path:
    """A calibration dataset of black frames: INT8 calibrated on it saturates on the shapes the camera
    sees, so the INT8 check rejects the engine (as tests/engines/test_service.py shows)."""
    directory.mkdir(parents=True)
    for i in range(count):
        cv2.imwrite(str(directory / f"black-{i:02d}.png"), np.zeros((64, 64, 3), np.uint8))
    return directory


def released_by(claims: ClaimBook, device: str, why: str) -> list[str]:
    """The keys whose claim ``device`` released with a reason containing ``why``."""
    return [
        key
        for key, holder, ended in claims.ended
        if holder == device and "released" in ended and why in ended
    ]


def test_an_int8_engine_the_check_rejects_releases_its_claim_and_the_next_wave_does_not_wait(
    fleet: Fleet, controller: RunningController, probe: Probe, device_id: str, tmp_path: Path
) -> None:
    devices = [f"{device_id}-{i}" for i in range(2)]
    files = serving_v1(fleet, probe, devices)
    calibration = CalibrationSource(kind="dataset", path=black_images(tmp_path / "black"), frames=16)
    options = {**GUARDED, "build": BuildSpec(precision="int8", device="cpu", calibration=calibration)}
    claims = controller.controller.engines.claims
    store = controller.controller.engines.store
    first, second = devices

    # Wave 1: the INT8 key claimed, built, rejected by the check; the device goes on at FP16 (its own
    # key, built, offered and stored) and the INT8 key's claim is released, not renewed for ever.
    wave1 = fleet.deploy(MODEL_PATH, [first], "2", **options)
    assert finish(wave1, timeout=300.0).devices[first].state is JobState.ACTIVE
    effective = effective_of(probe, wave1.job_id, first)
    assert effective["int8_guard"]["passed"] is False, effective
    assert effective["engine_source"]["origin"] == "built"
    wait_until(
        lambda: bool(released_by(claims, first, "the INT8 check rejected it")),
        timeout=60.0,
        what=f"{first} releasing the INT8 key's claim",
    )
    (int8_key,) = released_by(claims, first, "the INT8 check rejected it")
    wait_until(lambda: len(store.entries()) == 1, timeout=60.0, what="the FP16 engine stored")
    (stored,) = store.entries()
    assert stored.record.key != int8_key
    # The listing names its model, version and precision, as the builder's job said.
    (row,) = [
        r for rows in engines_listing(controller.controller.engines)["fingerprints"].values() for r in rows
    ]
    assert (row["model_id"], row["version"], row["precision"]) == ("cls", "2", effective["precision"])
    wait_until(lambda: len(claims) == 0, timeout=30.0, what="no claim left")

    # Wave 2: nobody holds the INT8 key, so the device builds it at once (and releases it in turn) and
    # downloads the FP16 engine: it never waits for a build nobody runs.
    wave2 = fleet.deploy(MODEL_PATH, [second], "2", **options)
    assert finish(wave2, timeout=300.0).devices[second].state is JobState.ACTIVE
    lines = progress_lines(files[second])
    assert not any("waiting for its engine" in line for line in lines), lines
    assert effective_of(probe, wave2.job_id, second)["engine_source"]["origin"] == "downloaded"
    assert released_by(claims, second, "the INT8 check rejected it") == [int8_key]
    wait_until(lambda: len(claims) == 0, timeout=30.0, what="no claim left after wave 2")
