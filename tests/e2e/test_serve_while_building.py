"""Serve while building: a daemon whose engine is not in the cache serves at once, then swaps.

A real daemon starts with an empty engine cache and a build request. Its build is real (ONNX
Runtime, in the build child), held back by :mod:`tests.engines.paced_build` until the test releases
it: results flow while the build runs, up/info says the slot serves its interim model and what
builds (phase, frames done / total, elapsed), and once the build is released the engine swaps in
with no frame lost.
"""

from __future__ import annotations

import itertools
import shutil
import uuid
from pathlib import Path

import pytest

from agent.demo.broker import Broker
from agent.engines.building.progress import PUBLISH_INTERVAL_S
from agent.fleet.cli.progress import progress_line
from agent.fleet.deploy.keys import KeyPairFiles, load_signing_key
from agent.fleet.deploy.plan import DeployPlan
from agent.fleet.deploy.run import FleetDeploy
from agent.protocol.messages import InfoMessage, JobState, JobStatus, SlotInfo, decode
from agent.specs.build import BuildSpec
from tests.e2e.daemon import AgentFiles, Daemon, unique_results
from tests.e2e.fleet_rig import Fleet, operator_settings
from tests.engines import paced_build
from tests.mqtt_probe import Probe, Received
from tests.waiting import patient

pytestmark = pytest.mark.slow


def _slot(messages: list[Received], device: str) -> SlotInfo | None:
    infos = [m for m in messages if m.topic == f"fleet/v1/{device}/up/info"]
    return decode(InfoMessage, infos[-1].payload).slots["cls"] if infos else None


def test_a_restart_with_an_empty_engine_cache_serves_at_once_and_swaps_without_a_lost_frame(
    tmp_path: Path, broker: Broker
) -> None:
    device = f"swb-{uuid.uuid4().hex[:8]}"
    files = AgentFiles(tmp_path, broker.port, device, frames=90)
    config = files.write_config(
        stream={"source": {"type": "file", "path": str(files.video), "loop": True, "realtime": True}},
        slot={"build": {"precision": "fp32", "device": "cpu"}},
    )
    gate = tmp_path / "release-build"
    results = f"fleet/v1/{device}/up/results/cam"
    with Probe(broker.host, broker.port) as probe:
        probe.subscribe(f"fleet/v1/{device}/up/#")
        daemon = Daemon(config, tmp_path / "agent.log", env=paced_build.env(gate))
        try:
            # Results within seconds, while the build is held (it cannot finish: the gate is shut).
            try:
                probe.wait_for_count(results, 10, timeout=30)
            except TimeoutError as exc:
                counts = {t: len(probe.on_topic(t)) for t in {m.topic for m in probe.snapshot()}}
                raise AssertionError(
                    f"{exc}; per topic {counts}; the daemon's log:\n{daemon.log()[-6000:]}"
                ) from exc
            held = probe.wait_for(
                lambda ms: (
                    (s := _slot(ms, device)) is not None
                    and s.building is not None
                    and s.building.phase == "calibrating"
                    and (s.building.frames_done or 0) > 0
                ),
                timeout=30,
            )
            during = _slot(held, device)
            assert not gate.exists()
            served_while_held = len(unique_results(probe.snapshot(), results))
            gate.touch()
            daemon.wait_for_event("slot.interim.swapped", timeout=120)
            after = probe.wait_for(
                lambda ms: (s := _slot(ms, device)) is not None and s.serving == "requested",
                timeout=30,
            )
            count = len(probe.on_topic(results))
            probe.wait_for_count(results, count + 15, timeout=30)
        finally:
            code = daemon.stop()
    assert code == 0, daemon.log()[-3000:]
    assert during is not None
    assert during.building is not None
    assert during.serving == "interim"
    # What runs meanwhile: the ONNX model, while the FP32 engine asked for builds.
    assert during.runs is not None
    assert during.runs.model_dump(exclude_none=True) == {"requested": "fp32", "source": "interim"}
    assert during.model is not None
    assert during.model.model_id == "cls"
    assert (during.building.model_id, during.building.frames_total) == ("cls", paced_build.FRAMES)
    assert during.building.elapsed_s >= 0
    assert served_while_held >= 10
    swapped = _slot(after, device)
    assert swapped is not None
    assert swapped.building is None
    assert swapped.runs is not None
    assert swapped.runs.model_dump(exclude_none=True) == {
        "requested": "fp32",
        "precision": "fp32",
        "source": "built",
    }
    events = daemon.events()
    interim = next(e for e in events if e.get("event") == "slot.interim.serving")
    assert interim["providers"] == ["CPUExecutionProvider"]
    ready = next(e for e in events if e.get("event") == "engine.ready")
    assert ready["cache_hit"] is False
    indices = [r.frame_index for r in unique_results(probe.snapshot(), results)]
    assert indices == list(range(len(indices))), "a frame was lost across the swap from the interim model"
    assert during.building.estimate_s is None  # no earlier build of this fingerprint

    # As after an upgrade: the engine cache is empty again, its build history kept. The restart
    # serves at once again, and its build now carries the estimate from the first one.
    for entry in (tmp_path / "state" / "engines").iterdir():
        if entry.is_dir():
            shutil.rmtree(entry)
    gate.unlink()
    with Probe(broker.host, broker.port) as probe:
        probe.subscribe(f"fleet/v1/{device}/up/#")
        daemon = Daemon(config, tmp_path / "agent-2.log", env=paced_build.env(gate))
        try:
            estimated = probe.wait_for(
                lambda ms: (
                    (s := _slot(ms, device)) is not None
                    and s.serving == "interim"
                    and s.building is not None
                    and s.building.estimate_s is not None
                ),
                timeout=30,
            )
            gate.touch()
            daemon.wait_for_event("slot.interim.swapped", timeout=120)
        finally:
            code = daemon.stop()
    assert code == 0, daemon.log()[-3000:]
    again = _slot(estimated, device)
    assert again is not None
    assert again.serving == "interim"
    assert again.building is not None
    assert again.building.estimate_s is not None
    assert again.building.estimate_s >= 0


def test_a_deployments_build_reports_its_phase_at_a_bounded_rate_and_fleet_deploy_shows_it(
    tmp_path: Path, broker: Broker, keys: KeyPairFiles
) -> None:
    """A delivered build held back by the test: the old model keeps serving, the job's BUILDING
    statuses carry phase, frames and elapsed (at most one per 2 s), and ``fleet deploy`` shows them."""
    fleet = Fleet(tmp_path, broker, keys)
    device = f"swb-{uuid.uuid4().hex[:8]}"
    files = fleet.files(device)
    gate = tmp_path / "release-build"
    results = f"fleet/v1/{device}/up/results/cam"
    lines: list[str] = []
    daemon = Daemon(files.config_path, files.root / "agent.log", env=paced_build.env(gate))
    fleet.daemons.append(daemon)
    try:
        with Probe(broker.host, broker.port) as probe:
            probe.subscribe(f"fleet/v1/{device}/up/#")
            probe.wait_for_count(results, 3, timeout=30)
            plan = DeployPlan(
                model=files.v2,
                devices=(device,),
                slot="cls",
                version="2",
                model_id="cls",
                build=BuildSpec.model_validate({"precision": "fp32", "device": "cpu"}),
            )
            deploy = FleetDeploy(
                operator_settings(broker),
                plan,
                signing_key=load_signing_key(keys.private),
                key_id=keys.key_id,
                status_poll_s=0.5,
                on_change=lambda snapshot: lines.extend(progress_line(p) for p in snapshot),
            ).start()
            jobs = f"fleet/v1/{device}/up/jobs/{deploy.job_id}"

            def building(messages: list[Received]) -> bool:
                statuses = [decode(JobStatus, m.payload) for m in messages if m.topic == jobs]
                return sum(1 for s in statuses if s.build is not None and (s.build.frames_done or 0) > 0) >= 3

            probe.wait_for(building, timeout=60)
            old_during_build = len(
                [r for r in unique_results(probe.snapshot(), results) if r.model.version == "1"]
            )
            probe.wait_for_count(results, len(probe.on_topic(results)) + 5, timeout=30)
            gate.touch()
            outcome = deploy.wait(timeout=patient(120))
            probe.wait_for(
                lambda ms: any(r.model.version == "2" for r in unique_results(ms, results)), timeout=30
            )
            statuses = [decode(JobStatus, m.payload) for m in probe.on_topic(jobs)]
            served = unique_results(probe.snapshot(), results)
    finally:
        fleet.close()
    assert outcome.devices[device].state is JobState.ACTIVE, outcome.devices[device]
    with_build = [s for s in statuses if s.build is not None]
    assert all(s.state is JobState.BUILDING for s in with_build)
    assert {s.build.phase for s in with_build if s.build is not None} >= {"calibrating"}
    assert all(
        s.build.frames_total == paced_build.FRAMES for s in with_build if s.build and s.build.frames_total
    )
    # At most one build update per 2 s; during the stand-in's silent wait, the heartbeat's updates
    # move elapsed on (three updates with frames counted need it: the build said two lines).
    stamps = [s.ts for s in with_build]
    assert all(b - a >= PUBLISH_INTERVAL_S - 0.1 for a, b in itertools.pairwise(stamps)), stamps
    elapsed = [s.build.elapsed_s for s in with_build if s.build is not None]
    assert elapsed == sorted(elapsed), elapsed
    assert elapsed[-1] > elapsed[0]
    # The old model kept serving while the build ran, then the new one, no frame lost.
    assert old_during_build >= 3
    assert served[-1].model.version == "2"
    assert [r.frame_index for r in served] == list(range(len(served)))
    assert any(f"{device}" in line and "calibrating" in line and "/500 frames" in line for line in lines), (
        lines
    )
