"""End to end: a class-swapped model rejected in shadow on a running daemon leaves evidence frames.

Real mosquitto, a real ``python -m agent run`` on a real video, the model deployed with the real
FleetDeploy, and the frames fetched with the real ``fleet evidence`` code over MQTT.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest

from agent.cli import main
from agent.fleet.devices.command import send_command
from agent.fleet.devices.evidence import fetch_evidence, save_evidence
from agent.protocol.messages import JobState
from agent.protocol.proving import ShadowSpec
from agent.runtime.slots.evidence import EvidenceBounds
from tests.e2e.fleet_rig import Fleet, final_status, finish, operator_settings
from tests.mqtt_probe import Probe
from tests.runtime.models import write_swapped_classes

pytestmark = pytest.mark.slow


def test_a_shadow_rejection_of_a_class_swapped_model_leaves_bounded_evidence_frames(
    fleet: Fleet,
    device_id: str,
    probe: Probe,
    tmp_path: Path,
) -> None:
    files, daemon, _ = fleet.serving_v1(device_id, probe)
    swapped = write_swapped_classes(files.v1, files.root / "swapped.onnx")

    job = fleet.deploy(swapped, [device_id], "2", shadow=ShadowSpec(frames=20, sample_fps=10.0))
    outcome = finish(job)
    progress = outcome.devices[device_id]
    assert (progress.state, progress.error_code) == (JobState.REJECTED, "shadow_disagrees"), progress
    final = final_status(probe, job.job_id, device_id)
    assert final.evidence is not None

    evidence = fetch_evidence(operator_settings(fleet.broker), device_id, job.job_id)
    written = save_evidence(evidence, tmp_path / "evidence")
    # The CLI, as docs/fleet.md shows it, writes the same files.
    broker_at = f"{fleet.broker.host}:{fleet.broker.port}"
    argv = ["fleet", "evidence", device_id, job.job_id, "-o", str(tmp_path / "cli"), "--broker", broker_at]
    assert main([*argv, "--prefix", "fleet/v1"]) == 0
    assert sorted(p.name for p in (tmp_path / "cli").iterdir()) == sorted(p.name for p in written)
    for path in written:
        if path.suffix == ".jpg":
            assert (tmp_path / "cli" / path.name).read_bytes() == path.read_bytes()
    bounds = EvidenceBounds()

    assert 1 <= final.evidence.frames <= bounds.frames
    assert len(evidence.frames) == final.evidence.frames
    assert sum(len(f.jpeg) for f in evidence.frames) == final.evidence.bytes
    assert all(len(f.jpeg) <= bounds.frame_bytes for f in evidence.frames)
    saved = json.loads((tmp_path / "evidence" / "evidence.json").read_text())
    assert saved["reason"] == "shadow_disagrees"
    assert len(written) == len(evidence.frames) + 1
    for frame, meta in zip(evidence.frames, saved["frames"], strict=True):
        image = cv2.imdecode(np.frombuffer(frame.jpeg, np.uint8), cv2.IMREAD_COLOR)
        assert image is not None
        assert image.shape[1] == meta["width"]
        assert meta["agreement"] == 0.0
        # Side by side: the serving model and the class-swapped candidate name different classes.
        assert meta["serving"]["classes"][0]["index"] != meta["candidate"]["classes"][0]["index"]
        assert (tmp_path / "evidence" / meta["file"]).read_bytes() == frame.jpeg
    # docs/protocol.md's examples are what this device sent: the same keys, in the status and replies.
    settings = operator_settings(fleet.broker)
    index_doc, frame_doc = _doc_examples("#### Evidence frames")
    (status_doc,) = _doc_examples("### Shadow and probation")
    index = send_command(settings, device_id, "evidence", {"job_id": job.job_id}).result or {}
    frame0 = send_command(settings, device_id, "evidence", {"job_id": job.job_id, "frame": 0}).result or {}
    assert set(index) == set(index_doc)
    assert set(index["frames"][0]) == set(index_doc["frames"][0])
    assert set(frame0) == set(frame_doc)
    assert set(status_doc) <= set(final.model_dump(mode="json", exclude_none=True))  # an excerpt
    assert set(status_doc["evidence"]) == set(final.evidence.model_dump())
    assert daemon.stop() == 0


def _doc_examples(heading: str) -> list[dict[str, Any]]:
    """The ```json blocks under ``heading`` of docs/protocol.md, up to the next heading."""
    text = (Path(__file__).parents[2] / "docs" / "protocol.md").read_text()
    section = text.split(heading + "\n", 1)[1]
    section = re.split(r"^#{2,4} ", section, flags=re.M)[0]
    return [json.loads(b) for b in re.findall(r"```json\n(.*?)```", section, re.S)]
