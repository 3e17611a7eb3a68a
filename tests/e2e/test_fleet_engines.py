"""End to end: build once per platform, for the whole fleet (issue 23.4).

Real mosquitto, the real fleet controller (its engine store, its chunk server, signing with the
operator's key), three real ``python -m agent run`` daemons on this host (one fingerprint), shadow
and probation on. The first device builds the INT8 engine, calibrating on its own stream, runs it
to ACTIVE through shadow and probation and offers it; the controller vouches for it. The other two
ask the controller on their cache miss, download and verify it (their job status says
``downloaded`` and how long it took), never calibrate, and run the very same engine: identical
outputs on the same frames.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.backends.base import LoadOptions, get_backend
from agent.camera.preprocess import preprocess
from agent.cli import main
from agent.datasets.shapes import MODEL_PATH, generate
from agent.demo.broker import Broker
from agent.fleet.deploy.keys import load_signing_key
from agent.fleet.engines.trust import sign_record
from agent.protocol.messages import JobState
from agent.protocol.proving import ProbationSpec, ShadowSpec
from agent.protocol.topics import Topics
from agent.signing import Ed25519PrivateKey
from agent.specs.build import BuildSpec, CalibrationSource
from agent.specs.preprocess import PreprocessSpec
from tests.e2e.daemon import AgentFiles
from tests.e2e.fleet_rig import Fleet, count_version, finish, job_statuses
from tests.fleet.controller.loop_thread import RunningController
from tests.fleet.engines.records import engine_file as engine_file_of
from tests.mqtt_probe import Probe
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

#: What the test is about is where the engine comes from; loose speed bars keep a loaded host (three
#: agents on two cores) from rolling a good engine back as slow.
SHADOW = ShadowSpec(frames=10, sample_fps=10.0, min_agreement=0.8, max_latency_ratio=1000.0)
PROBATION = ProbationSpec(min_fps_ratio=0.1, max_p99_ratio=1000.0, max_drop_increase=0.9)
INT8_STREAM = BuildSpec(
    precision="int8", device="cpu", calibration=CalibrationSource(kind="stream", frames=32)
)


@pytest.fixture
def controller(tmp_path: Path, broker: Broker, fleet: Fleet) -> Iterator[RunningController]:
    running = RunningController(fleet.controller_config(tmp_path / "controller"))
    yield running
    running.stop()


def effective_of(probe: Probe, job_id: str, device: str) -> dict[str, Any]:
    effective = [s.effective for s in job_statuses(probe, job_id, device) if s.effective]
    assert effective, f"{device}: no job status carried the effective build"
    return effective[-1]


def progress_lines(files: AgentFiles) -> list[str]:
    """The build progress lines the device's daemons logged."""
    return [line for log in sorted(files.root.glob("agent-*.log")) for line in progress_lines_of(log)]


def progress_lines_of(log: Path) -> list[str]:
    """The build progress lines of one daemon's log (JSON log lines ``engine.build.progress``)."""
    logged = log.read_text(errors="replace").splitlines()
    return [str(json.loads(line).get("message", "")) for line in logged if '"engine.build.progress"' in line]


def outputs(engine: Path, frames: np.ndarray) -> np.ndarray:
    runner = get_backend("onnxruntime").load(engine, LoadOptions())
    try:
        return next(iter(runner.infer({"images": frames}).values()))
    finally:
        runner.close()


def test_one_device_builds_the_int8_engine_and_two_download_it_from_the_controller(
    fleet: Fleet,
    controller: RunningController,
    probe: Probe,
    device_id: str,
    broker: Broker,
    capsys: pytest.CaptureFixture[str],
) -> None:
    devices = [f"{device_id}-{i}" for i in range(3)]
    probe.subscribe("fleet/v1/+/up/#")
    files = {device: fleet.start_shapes(device) for device in devices}
    for device in devices:
        probe.wait_for(count_version("1", Topics("fleet/v1", device).results("cam")), timeout=180)
    store = controller.controller.engines.store

    # The builder: calibrates on its stream, builds, runs shadow and probation to ACTIVE, offers.
    first = fleet.deploy(
        MODEL_PATH,
        devices[:1],
        "2-int8",
        build=INT8_STREAM,
        share_engines=True,
        shadow=SHADOW,
        probation_s=2.0,
        probation=PROBATION,
    )
    built = finish(first, timeout=300.0).devices[devices[0]]
    assert built.state is JobState.ACTIVE, built
    assert {JobState.SHADOW, JobState.PROBATION} <= set(built.history)
    source = effective_of(probe, first.job_id, devices[0])["engine_source"]
    assert source["origin"] == "built", source
    wait_until(
        lambda: len(store.entries()) == 1, timeout=60, what="the controller to store the offered engine"
    )
    (stored,) = store.entries()
    assert stored.record.built_by == devices[0]
    assert stored.record.job_id == first.job_id

    # The others: ask on their cache miss, download, verify, and still shadow and probation it.
    rest = fleet.deploy(
        MODEL_PATH,
        devices[1:],
        "2-int8",
        build=INT8_STREAM,
        share_engines=True,
        shadow=SHADOW,
        probation_s=2.0,
        probation=PROBATION,
    )
    outcome = finish(rest, timeout=300.0)
    engines = []
    for device in devices:
        job_id = first.job_id if device == devices[0] else rest.job_id
        effective = effective_of(probe, job_id, device)
        if device != devices[0]:
            progress = outcome.devices[device]
            assert progress.state is JobState.ACTIVE, progress
            assert {JobState.SHADOW, JobState.PROBATION} <= set(progress.history)
            source = effective["engine_source"]
            assert source["origin"] == "downloaded", source
            assert source["built_by"] == devices[0]
            # What the job and the deploy say runs: the INT8 asked, from the fleet.
            assert progress.runs is not None
            assert (progress.runs.precision, progress.runs.source) == ("int8", "downloaded"), progress.runs
            assert source["seconds"] >= 0
            lines = progress_lines(files[device])
            assert any("downloaded engine" in line for line in lines), lines
            assert not any(line.startswith("calibrating") for line in lines), lines  # skipped calibration
        engines.append(Path(effective["calibration"]["table"]).parent / "model.onnx")
    assert any(line.startswith("calibrating") for line in progress_lines(files[devices[0]]))
    assert store.entries()[0].reuse == 2
    # The operator sees it: per fingerprint, who built it, how often it was reused.
    capsys.readouterr()
    assert main(["fleet", "engines", "list", "--json", "--broker", f"{broker.host}:{broker.port}"]) == 0
    listing = json.loads(capsys.readouterr().out)
    ((fingerprint, rows),) = listing["fingerprints"].items()
    assert fingerprint.startswith("onnxruntime ")
    assert [(r["built_by"], r["reuse"]) for r in rows] == [(devices[0], 2)]
    # The same bytes on every device, so the same outputs on the same frames.
    assert engines[0].read_bytes() == engines[1].read_bytes() == engines[2].read_bytes()
    assert len({str(p) for p in engines}) == 3  # each device's own cache
    images, _labels = generate(8, seed=77)
    frames = np.stack([preprocess(image, PreprocessSpec(width=64, height=64))[0] for image in images])
    reference = outputs(engines[0], frames)
    for engine in engines[1:]:
        np.testing.assert_array_equal(outputs(engine, frames), reference)

    # Back with an empty engine cache (an eviction, a lost disk): the start-up rebuild asks the fleet
    # too (the deployment shared engines), serves its ONNX model meanwhile, and downloads.
    last = devices[2]
    (daemon,) = [d for d in fleet.daemons if d.log_path.parent == files[last].root]
    assert daemon.stop() == 0
    shutil.rmtree(files[last].root / "state" / "engines")
    restarted = fleet.start(files[last])

    def downloaded() -> bool:
        return any("downloaded engine" in line for line in progress_lines_of(restarted.log_path))

    wait_until(downloaded, timeout=120, what=f"{last} to download its engine at start-up")
    probe.clear()
    probe.wait_for(count_version("2-int8", Topics("fleet/v1", last).results("cam")), timeout=60)
    assert not any(line.startswith("calibrating") for line in progress_lines_of(restarted.log_path))
    assert store.entries()[0].reuse == 3


def vouch_for_bad_bytes(
    controller: RunningController, key: str, operator: Ed25519PrivateKey, key_id: str
) -> str:
    """The stored engine replaced by bytes no runtime loads, signed with the operator's key: what a
    device that shipped a broken engine through its own shadow and probation would leave behind."""
    desk = controller.controller.engines
    stored = desk.store.get(key)
    assert stored is not None
    bad = b"not an onnx model" * 64
    bad_sha = hashlib.sha256(bad).hexdigest()
    (desk.store.blobs / f"{bad_sha}.onnx").write_bytes(bad)
    engine_file = str(stored.record.meta["engine_file"])
    files = [f if f.name != engine_file else engine_file_of(f.name, bad) for f in stored.record.files]
    meta = {**stored.record.meta, "engine_sha256": bad_sha, "engine_bytes": len(bad)}
    record = stored.record.model_copy(update={"files": files, "meta": meta})
    signed = sign_record(record, operator, key_id)
    desk.store._index.engines[key] = stored.model_copy(update={"record": record, "signed": signed})
    return bad_sha


def test_a_shared_engine_that_fails_to_load_is_dropped_the_device_builds_and_the_fleet_withdraws_it(
    fleet: Fleet, controller: RunningController, probe: Probe, device_id: str
) -> None:
    devices = [f"{device_id}-{i}" for i in range(2)]
    probe.subscribe("fleet/v1/+/up/#")
    for device in devices:
        fleet.start_shapes(device)
    for device in devices:
        probe.wait_for(count_version("1", Topics("fleet/v1", device).results("cam")), timeout=180)
    store = controller.controller.engines.store
    fp32 = BuildSpec(precision="fp32", device="cpu")  # no INT8 guard: the load is the first check
    options: dict[str, Any] = {"build": fp32, "share_engines": True, "shadow": SHADOW, "probation_s": 2.0}
    first = fleet.deploy(MODEL_PATH, devices[:1], "2", probation=PROBATION, **options)
    assert finish(first, timeout=300.0).devices[devices[0]].state is JobState.ACTIVE
    # Counted once the store's add has ended, its sweep of unreferenced blobs included (the entry is
    # listed before that sweep, which once removed the bad blob written below).
    desk = controller.controller.engines
    wait_until(
        lambda: desk.stats["stored"] == 1, timeout=60, what="the controller to store the offered engine"
    )
    key = store.entries()[0].record.key
    bad_sha = vouch_for_bad_bytes(controller, key, load_signing_key(fleet.keys.private), fleet.keys.key_id)

    second = fleet.deploy(MODEL_PATH, devices[1:], "2", probation=PROBATION, **options)
    progress = finish(second, timeout=300.0).devices[devices[1]]
    # The downloaded engine failed to load: dropped, built here in the same job, shadowed, ACTIVE.
    assert progress.state is JobState.ACTIVE, progress
    assert {JobState.SHADOW, JobState.PROBATION} <= set(progress.history)
    effective = effective_of(probe, second.job_id, devices[1])
    assert effective["engine_source"]["origin"] == "built", effective
    assert "ONNX Runtime cannot load" in effective["fleet_engine_failed"]
    # The controller heard of it and withdrew the engine fleet-wide, remembering the bad bytes.
    wait_until(lambda: store.get(key) is None, timeout=30, what="the bad engine withdrawn")
    assert (key, bad_sha) in store.withdrawn()
