"""End to end: a slot with an INT8 build request, calibrated on its own live stream, guarded, swapped in."""

from __future__ import annotations

import json
import signal
import uuid
from pathlib import Path

import pytest
import yaml

from agent.demo.broker import Broker
from agent.fleet.deploy.plan import DeployPlan
from agent.fleet.deploy.run import FleetDeploy
from agent.mqtt.settings import MqttSettings
from agent.protocol.messages import JobStatus, decode
from agent.specs.build import BuildSpec
from tests.e2e.daemon import REPO, Daemon, unique_results
from tests.e2e.fleet_rig import shapes_video
from tests.mqtt_probe import Probe
from tests.waiting import patient

pytestmark = pytest.mark.slow

SHAPES = REPO / "agent" / "assets" / "shapes_classifier.onnx"


def _config(tmp_path: Path, port: int, device: str, video: Path, agreement: float) -> Path:
    config = {
        "device_id": device,
        "state_dir": str(tmp_path / "state"),
        "mqtt": {"host": "127.0.0.1", "port": port},
        "slots": {
            "cls": {
                "model": str(SHAPES),
                "version": "1",
                "preprocess": {"width": 64, "height": 64},
                "postprocess": {
                    "type": "classification",
                    "top_k": 1,
                    "labels_file": str(SHAPES.with_name("shapes_labels.txt")),
                },
                "build": {
                    "precision": "int8",
                    "device": "cpu",
                    "calibration": {"kind": "stream", "frames": 24},
                },
            }
        },
        "streams": {
            "cam": {
                "source": {"type": "file", "path": str(video), "loop": True, "realtime": True},
                "slot": "cls",
                "drop_policy": "process_all",
                "results_qos": 1,
            }
        },
        "engines": {"guard_frames": 24, "int8_agreement": agreement},
        "telemetry": {"interval_s": 5},
        "logging": {"format": "json", "level": "info"},
    }
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_int8_from_live_frames_goes_live_past_the_guard(tmp_path: Path, broker: Broker) -> None:
    """The slot starts on the ONNX model, calibrates INT8 on its own stream, passes the guard, swaps."""
    agreement, precision = 0.8, "int8"
    device = f"eng-{uuid.uuid4().hex[:8]}"
    video = shapes_video(tmp_path / "shapes.avi", 90)
    topic = f"fleet/v1/{device}/up/results/cam"
    with Probe(broker.host, broker.port) as probe:
        probe.subscribe(topic)
        daemon = Daemon(_config(tmp_path, broker.port, device, video, agreement), tmp_path / "agent.log")
        try:
            ready = daemon.wait_for_event("engine.ready", timeout=120)
            count = len(probe.on_topic(topic))
            probe.wait_for_count(topic, count + 20, timeout=30)
        finally:
            code = daemon.stop()
    assert code == 0, daemon.log()[-3000:]
    effective = ready["effective"]
    guard = effective["int8_guard"]
    assert guard["n"] >= 24
    assert guard["passed"] is (precision == "int8")
    assert effective["precision"] in ({"int8"} if precision == "int8" else {"fp16", "fp32"})
    results = unique_results(probe.snapshot(), topic)
    indices = [r.frame_index for r in results]
    assert indices == list(range(len(indices))), "a frame was lost across the engine swap"
    assert results[-1].classes is not None
    assert results[-1].classes[0].label in {"circle", "square", "triangle", "star", "cross"}
    assert ready["cache_hit"] is False

    # A restart with the same model and build request finds the engine in the cache: no rebuild.
    daemon = Daemon(tmp_path / "agent.yaml", tmp_path / "agent-2.log")
    try:
        again = daemon.wait_for_event("engine.ready", timeout=120)
    finally:
        assert daemon.stop() == 0
    assert again["cache_hit"] is True
    assert again["effective"]["precision"] == "int8"


def test_calibrate_command_stores_and_reuses(tmp_path: Path, broker: Broker) -> None:
    device = f"cal-{uuid.uuid4().hex[:8]}"
    video = shapes_video(tmp_path / "shapes.avi", 60)
    config = yaml.safe_load(_config(tmp_path, broker.port, device, video, 0.8).read_text())
    del config["slots"]["cls"]["build"]
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(config))
    with Probe(broker.host, broker.port) as probe:
        probe.subscribe(f"fleet/v1/{device}/up/#")
        daemon = Daemon(path, tmp_path / "agent.log")
        try:
            probe.wait_for_count(f"fleet/v1/{device}/up/results/cam", 5, timeout=60)
            replies = []
            for i in range(2):
                probe.publish(
                    f"fleet/v1/{device}/down/cmd/calibrate",
                    json.dumps({"args": {"slot": "cls", "frames": 16}}).encode(),
                    qos=1,
                    response_topic=f"fleet/v1/{device}/up/cmd/calibrate",
                    correlation_data=f"c{i}".encode(),
                )
                replies = probe.wait_for_count(f"fleet/v1/{device}/up/cmd/calibrate", i + 1, timeout=90)
            # Mistakes get their own codes from the real handlers, not internal_error.
            mistakes = [
                ("calibrate", {"slot": "cls", "frames": "many"}),
                ("calibrate", {"slot": "nope"}),
                ("rollback", {"slot": "nope"}),
            ]
            for name, args in mistakes:
                payload = json.dumps({"args": args}).encode()
                probe.publish(f"fleet/v1/{device}/down/cmd/{name}", payload, qos=1)
            wrong = [
                *probe.wait_for_count(f"fleet/v1/{device}/up/cmd/calibrate", 4, timeout=30)[2:],
                *probe.wait_for_count(f"fleet/v1/{device}/up/cmd/rollback", 1, timeout=30),
            ]
        finally:
            daemon.signal(signal.SIGTERM)
            code = daemon.stop()
    assert code == 0
    first, second = (json.loads(r.payload) for r in replies)
    assert first["ok"], first
    assert first["result"]["frames"] == 16
    assert Path(first["result"]["table"]).is_file()
    # Different live frames give a different data hash: a new entry; the same key would be reused.
    assert second["ok"]
    assert [r.correlation_data for r in replies] == [b"c0", b"c1"]
    bad_frames, calibrate_nope, rollback_nope = (json.loads(r.payload) for r in wrong)
    assert (bad_frames["error_code"], bad_frames["ok"]) == ("bad_args", False), bad_frames
    assert "'frames'" in bad_frames["error"]
    assert "'many'" in bad_frames["error"]
    assert calibrate_nope["error_code"] == "wrong_slot", calibrate_nope
    assert rollback_nope["error_code"] == "wrong_slot", rollback_nope
    assert "'nope'" in rollback_nope["error"]
    assert "cls" in rollback_nope["error"]


def test_deployment_with_an_int8_build_reports_requested_and_effective(
    tmp_path: Path, broker: Broker
) -> None:
    """A manifest asking for INT8 calibrated on the live stream: BUILDING runs the guard, the job says so."""
    device = f"dep8-{uuid.uuid4().hex[:8]}"
    video = shapes_video(tmp_path / "shapes.avi", 90)
    config = yaml.safe_load(_config(tmp_path, broker.port, device, video, 0.8).read_text())
    del config["slots"]["cls"]["build"]
    config["delivery"] = {"require_signature": False}
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(config))
    spec = BuildSpec.model_validate(
        {"precision": "int8", "device": "auto", "calibration": {"kind": "stream", "frames": 24}}
    )
    plan = DeployPlan(model=SHAPES, devices=(device,), slot="cls", version="8", model_id="shapes", build=spec)
    jobs_topic = f"fleet/v1/{device}/up/jobs/+"
    with Probe(broker.host, broker.port) as probe:
        probe.subscribe(jobs_topic)
        daemon = Daemon(path, tmp_path / "agent.log")
        deploy = FleetDeploy(MqttSettings(host=broker.host, port=broker.port), plan)
        try:
            deploy.start()
            outcome = deploy.wait(timeout=patient(120))
        finally:
            deploy.stop()
            code = daemon.stop()
        statuses = [decode(JobStatus, m.payload) for m in probe.snapshot() if "/up/jobs/" in m.topic]
    assert code == 0
    assert outcome.ok, f"{outcome.failures()} / agent log: {daemon.log()[-3000:]}"
    final = statuses[-1]
    assert final.state.value == "ACTIVE"
    assert final.requested is not None
    assert final.requested["precision"] == "int8"
    assert final.effective is not None
    assert final.effective["precision"] == "int8"
    assert final.effective["int8_guard"]["passed"] is True
    assert "build" in final.timings_s
    building = [s.progress for s in statuses if s.state.value == "BUILDING" and s.progress is not None]
    assert building == sorted(building)
    state = json.loads((tmp_path / "state" / "state.json").read_text())
    active = state["slots"]["cls"]["active"]
    assert active["origin"] == "delivery"
    assert active["build"]["precision"] == "int8"
    assert (tmp_path / "state" / "engines" / active["engine_key"]).is_dir()

    # After a restart the slot comes back on the deployed INT8 engine, from the engine cache.
    daemon = Daemon(path, tmp_path / "agent-2.log")
    try:
        ready = daemon.wait_for_event("engine.ready", timeout=120)
    finally:
        assert daemon.stop() == 0
    assert ready["cache_hit"] is True
    assert ready["key"] == active["engine_key"]
    assert ready["effective"]["precision"] == "int8"


def test_a_failing_build_fails_the_job_and_the_camera_loop_keeps_serving(
    tmp_path: Path, broker: Broker
) -> None:
    """A real build child that runs out of its memory limit: the job FAILS naming why; frames flow on."""
    device = f"oom-{uuid.uuid4().hex[:8]}"
    video = shapes_video(tmp_path / "shapes.avi", 60)
    config = yaml.safe_load(_config(tmp_path, broker.port, device, video, 0.8).read_text())
    del config["slots"]["cls"]["build"]
    config["delivery"] = {"require_signature": False}
    config["engines"] = {"build_memory_mb": 48}  # far too little for a Python child with ONNX Runtime
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(config))
    spec = BuildSpec.model_validate({"precision": "fp32", "device": "cpu"})
    plan = DeployPlan(model=SHAPES, devices=(device,), slot="cls", version="9", model_id="shapes", build=spec)
    results_topic = f"fleet/v1/{device}/up/results/cam"
    with Probe(broker.host, broker.port) as probe:
        probe.subscribe(f"fleet/v1/{device}/up/#")
        daemon = Daemon(path, tmp_path / "agent.log")
        deploy = FleetDeploy(MqttSettings(host=broker.host, port=broker.port), plan)
        try:
            probe.wait_for_count(results_topic, 5, timeout=60)
            deploy.start()
            outcome = deploy.wait(timeout=patient(120))
            count = len(probe.on_topic(results_topic))
            probe.wait_for_count(results_topic, count + 15, timeout=30)
        finally:
            deploy.stop()
            code = daemon.stop()
    assert code == 0
    result = outcome.devices[device]
    assert result.state is not None
    assert result.state.value == "FAILED"
    assert result.error_code == "build_failed"
    assert result.error is not None
    assert "memory" in result.error
    results = unique_results(probe.snapshot(), results_topic)
    assert [r.frame_index for r in results] == list(range(len(results)))
    assert {r.model.version for r in results} == {"1"}
