"""End to end: the operator's INT8 calibration travels with the model, and every device builds the same
engine from it instead of calibrating on its own frames.

Real mosquitto, two real ``python -m agent run`` daemons serving the FP32 shapes model, the real
FleetDeploy (signed manifest, the calibration as a signed artifact pulled in chunks like the model),
shadow and probation on. The calibration is a table the agent's own INT8 build wrote.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agent.backends.base import LoadOptions, get_backend
from agent.camera.preprocess import preprocess
from agent.datasets.shapes import MODEL_PATH, generate
from agent.engines.calibration.int8 import quantize_int8
from agent.protocol.messages import JobState
from agent.protocol.proving import ProbationSpec, ShadowSpec
from agent.protocol.topics import Topics
from agent.specs.build import BuildSpec
from agent.specs.preprocess import PreprocessSpec
from tests.e2e.fleet_rig import Fleet, count_version, finish, job_statuses
from tests.e2e.test_shadow_int8 import CALIBRATION_SEED
from tests.mqtt_probe import Probe

pytestmark = pytest.mark.slow


def operator_table(root: Path) -> Path:
    """What an operator ships: the calibration table of an INT8 build calibrated on 64 images."""
    images, _labels = generate(64, seed=CALIBRATION_SEED)
    spec = PreprocessSpec(width=64, height=64)
    batch = np.stack([preprocess(image, spec)[0] for image in images])
    return quantize_int8(MODEL_PATH, root / "operator", [batch]).table_path


def outputs(engine: Path, frames: np.ndarray) -> np.ndarray:
    runner = get_backend("onnxruntime").load(engine, LoadOptions())
    try:
        return next(iter(runner.infer({"images": frames}).values()))
    finally:
        runner.close()


def test_every_device_builds_the_same_int8_engine_from_the_shipped_calibration(
    fleet: Fleet, tmp_path: Path, probe: Probe, device_id: str
) -> None:
    devices = [f"{device_id}-{i}" for i in range(2)]
    probe.subscribe("fleet/v1/+/up/#")
    for device in devices:
        files = fleet.shapes_files(device)
        fleet.start(files)
    for device in devices:
        probe.wait_for(count_version("1", Topics("fleet/v1", device).results("cam")), timeout=180)

    table = operator_table(tmp_path)
    deploy = fleet.deploy(
        MODEL_PATH,
        devices,
        "2-int8",
        build=BuildSpec(precision="int8", device="cpu"),
        calib_cache=table,
        shadow=ShadowSpec(frames=10, sample_fps=10.0, min_agreement=0.8, max_latency_ratio=4.0),
        probation_s=2.0,
        # What this test is about is the calibration; loose speed bars keep a loaded host (two agents
        # building at once) from rolling a good engine back as slow.
        probation=ProbationSpec(min_fps_ratio=0.1, max_p99_ratio=1000.0, max_drop_increase=0.9),
    )
    outcome = finish(deploy, timeout=120.0)
    engines = []
    for device in devices:
        progress = outcome.devices[device]
        assert progress.state is JobState.ACTIVE, progress
        assert JobState.SHADOW in progress.history
        assert JobState.PROBATION in progress.history
        building = [s for s in job_statuses(probe, deploy.job_id, device) if s.effective]
        effective = building[-1].effective
        assert effective is not None
        assert effective["int8_mode"] == "qdq"
        assert effective["calibration"]["source"] == "given"  # quantized with the shipped table
        engines.append(Path(effective["calibration"]["table"]).parent / "model.onnx")
    # The same bytes on both devices, so the same outputs on the same frames.
    assert engines[0].read_bytes() == engines[1].read_bytes()
    images, _labels = generate(8, seed=77)
    frames = np.stack([preprocess(image, PreprocessSpec(width=64, height=64))[0] for image in images])
    np.testing.assert_array_equal(outputs(engines[0], frames), outputs(engines[1], frames))
