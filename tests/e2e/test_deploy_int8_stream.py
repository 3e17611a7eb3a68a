"""End to end: docs/fleet.md's INT8 deploy example, run as written against an agent configured like
configs/local.yaml (the bundled shapes classifier on the synthetic camera, no calibration anywhere
in its config).

Real mosquitto, a real ``python -m agent run`` daemon, the operator's ``edge-agent fleet deploy``
through the real CLI with the build flags copied from the page. The device has no DLA and no
TensorRT: its plan moves the engine to ONNX Runtime on the CPU, calibrates on its own frames and
runs the job to ACTIVE.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import onnx
import pytest
import yaml

from agent.cli import main
from agent.demo.broker import Broker
from agent.protocol.messages import JobStatus, decode
from agent.protocol.topics import Topics
from tests.e2e.daemon import REPO
from tests.e2e.fleet_rig import ENDS_ONLY_PROBATION, Fleet, count_version, ends_only_shadow
from tests.mqtt_probe import Probe

pytestmark = pytest.mark.slow

LOCAL = REPO / "configs" / "local.yaml"
FLEET_DOC = REPO / "docs" / "fleet.md"


def documented_build_flags() -> list[str]:
    """The build flags of fleet.md's ``--engine-device dla0`` deploy example (between the version and
    the key), so the test runs what the page says."""
    for block in re.findall(r"```sh\n(.*?)```", FLEET_DOC.read_text(), re.S):
        if "fleet deploy" in block and "--engine-device dla0" in block:
            words = shlex.split(block.replace("\\\n", " "))
            return words[words.index("--version") + 2 : words.index("--key")]
    raise AssertionError("docs/fleet.md has no fleet deploy example with --engine-device dla0")


def local_like_config(fleet: Fleet, root: Path, device: str, broker: Broker) -> Path:
    """configs/local.yaml with this test's device id, broker, state dir and trusted key; its relative
    paths made absolute (the copy lives elsewhere) and its camera at 30 fps (calibration time)."""
    config: dict[str, Any] = yaml.safe_load(LOCAL.read_text())
    slot = config["slots"]["shapes"]
    slot["model"] = str((LOCAL.parent / slot["model"]).resolve())
    post = slot["postprocess"]
    post["labels_file"] = str((LOCAL.parent / post["labels_file"]).resolve())
    config["streams"]["camera"]["source"]["fps"] = 30
    config.update(
        device_id=device,
        state_dir=str(root / "state"),
        mqtt={"host": broker.host, "port": broker.port},
        delivery={"trusted_keys": {fleet.keys.key_id: str(fleet.keys.public)}},
        logging={"format": "json", "level": "info"},
    )
    assert "calibration" not in LOCAL.read_text()
    path = root / "local.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_documented_int8_deploy_runs_to_active_on_a_device_configured_like_local_yaml(
    fleet: Fleet, broker: Broker, probe: Probe, device_id: str, tmp_path: Path
) -> None:
    files = fleet.files(device_id)
    config = local_like_config(fleet, files.root, device_id, broker)
    files.config_path = config
    daemon = fleet.start(files)
    results = Topics("fleet/v1", device_id).results("camera")
    probe.wait_for(count_version("1", results), timeout=120)
    # The same classifier under another version: new bytes (a note in its metadata), a new job.
    model = onnx.load(str(yaml.safe_load(config.read_text())["slots"]["shapes"]["model"]))
    model.doc_string = "version 2: the INT8 deploy example"
    onnx.save(model, str(tmp_path / "shapes-2.onnx"))
    flags = documented_build_flags()

    argv = ["fleet", "deploy", str(tmp_path / "shapes-2.onnx"), "--device", device_id, "--slot", "shapes"]
    argv += ["--version", "2", *flags, "--key", str(fleet.keys.private), "--key-id", fleet.keys.key_id]
    # Test pace only: a short probation (the page's example keeps the 60 s default). The build flags
    # are what this test is about: shadow and probation judge ends only, not a loaded host's latency.
    argv += ["--probation-s", "3", "--timeout", "300", "--broker", f"{broker.host}:{broker.port}"]
    argv += ["--shadow-json", ends_only_shadow().model_dump_json()]
    argv += ["--probation-json", ENDS_ONLY_PROBATION.model_dump_json()]
    assert main(argv) == 0, daemon.log()[-3000:]
    probe.wait_for(count_version("2", results), timeout=60)
    ended = [
        decode(JobStatus, m.payload)
        for m in probe.snapshot()
        if "/up/jobs/" in m.topic and b'"ACTIVE"' in m.payload
    ]
    assert daemon.stop() == 0, daemon.log()[-3000:]

    assert flags[:4] == ["--precision", "int8", "--calibration", "stream"], flags
    (job,) = ended
    assert job.requested is not None
    assert job.requested["calibration"] == {"kind": "stream", "frames": 200}
    effective = job.effective or {}
    assert (effective["backend"], effective["device"], effective["precision"]) == (
        "onnxruntime",
        "cpu",
        "int8",
    )
    assert effective["calibration"]["source"] == "frames"  # calibrated on the device's own stream
