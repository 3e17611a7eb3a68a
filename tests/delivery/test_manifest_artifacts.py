"""A manifest's artifacts (the operator's INT8 calibration): described, signed, referenced, checked."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from agent.demo.modelzoo import write_classifier
from agent.fleet.deploy.manifest import plan_manifest
from agent.fleet.deploy.plan import CALIBRATION_ARTIFACT, DeployPlan
from agent.model_contract.calibration_table import write_table
from agent.protocol.delivery_errors import BadManifestError, BadNameError, BadSignatureError
from agent.protocol.device_targets import MAX_RELEASE_WHEELS
from agent.protocol.manifest import (
    MAX_ARTIFACTS,
    DeployManifest,
    build_manifest,
    describe_artifact,
    parse_signed,
    sign_manifest,
)
from agent.signing import generate_keypair, private_key_from_bytes, public_key_from_bytes
from agent.specs.build import BuildSpec, CalibrationSource

DEVICE = "jet-01"
CALIBRATION = BuildSpec(
    precision="int8", device="cpu", calibration=CalibrationSource(kind="cache", artifact="calib")
)


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    model = write_classifier(tmp_path / "m.onnx", input_size=32, seed=4)
    table = tmp_path / "calibration.json"
    write_table(table, {f"t{i}": (-1.0, float(i)) for i in range(200)}, method="entropy")
    return model, table


def signed(model: Path, **kw: Any) -> tuple[bytes, Any]:
    private_pem, public_pem = generate_keypair()
    manifest = build_manifest(
        model, job_id="job-1", sequence=1, slot="main", model_id="cls", version="1", chunk_size=4096, **kw
    )
    return sign_manifest(manifest, private_key_from_bytes(private_pem), "op"), public_key_from_bytes(
        public_pem
    )


def test_an_artifact_travels_signed_and_is_described_for_the_same_fetch_path(
    files: tuple[Path, Path],
) -> None:
    model, table = files
    artifact = describe_artifact(table, name="calib", kind="calibration", chunk_size=1024)
    assert artifact.size == table.stat().st_size
    assert len(artifact.chunks) > 1
    payload, public = signed(model, build=CALIBRATION, artifacts=[artifact])
    manifest = parse_signed(payload, {"op": public}, True, DEVICE)
    assert manifest.artifact("calib") == artifact
    assert manifest.build is not None
    assert manifest.build.calibration is not None
    assert manifest.build.calibration.artifact == "calib"
    view = manifest.for_artifact(artifact)
    assert (view.sha256, view.size, view.chunks) == (artifact.sha256, artifact.size, artifact.chunks)
    assert [s.kind for s in view.sources] == ["mqtt"]
    # The artifact's hashes are signed: changing one breaks the signature.
    outer = json.loads(payload)
    outer["manifest"] = outer["manifest"].replace(artifact.sha256, "0" * 64)
    with pytest.raises(BadSignatureError):
        parse_signed(json.dumps(outer).encode(), {"op": public}, True, DEVICE)


def test_a_build_naming_a_missing_artifact_is_refused_naming_it(files: tuple[Path, Path]) -> None:
    model, _table = files
    with pytest.raises(
        ValueError, match=r"build\.calibration\.artifact 'calib' names no calibration artifact"
    ):
        signed(model, build=CALIBRATION)


def test_an_unsigned_tampered_artifact_list_is_refused_with_the_field(files: tuple[Path, Path]) -> None:
    model, table = files
    artifact = describe_artifact(table, name="calib", kind="calibration", chunk_size=1024)
    payload, public = signed(model, build=CALIBRATION, artifacts=[artifact])
    inner = json.loads(json.loads(payload)["manifest"])
    inner["artifacts"][0]["chunks"] = inner["artifacts"][0]["chunks"][:-1]
    unsigned = json.dumps({"manifest": json.dumps(inner)}).encode()
    with pytest.raises(BadManifestError, match=r"manifest\.artifacts\.0: .*chunks has"):
        parse_signed(unsigned, {"op": public}, False, DEVICE)
    inner["artifacts"][0]["name"] = "../etc"
    with pytest.raises(BadNameError, match="artifact name"):
        parse_signed(json.dumps({"manifest": json.dumps(inner)}).encode(), {"op": public}, False, DEVICE)


def test_the_protocol_doc_example_is_valid_and_what_fleet_deploy_sends(tmp_path: Path) -> None:
    doc = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
    found = re.search(r"^#### Manifest artifacts.*?```json\n(.*?)```", doc.read_text(), re.S | re.M)
    assert found, "docs/protocol.md has no '#### Manifest artifacts' section with a ```json example"
    example = json.loads(found.group(1))
    model = write_classifier(tmp_path / "m.onnx", input_size=32, seed=4)
    table = tmp_path / "calibration.json"
    write_table(table, {"x": (-1.0, 1.0)}, method="entropy")
    plan = DeployPlan(
        model=model,
        devices=("jet-01",),
        slot="main",
        version="1",
        build=BuildSpec(precision="int8", device="cpu"),
        calib_cache=table,
    )
    sent = json.loads(plan_manifest(plan, "job-1", 1).model_dump_json(exclude_none=True))
    assert sent["build"] == example["build"]
    assert [sorted(a) for a in sent["artifacts"]] == [sorted(a) for a in example["artifacts"]]
    assert sent["artifacts"][0]["name"] == example["artifacts"][0]["name"] == CALIBRATION_ARTIFACT
    # The doc's own artifact list validates as a manifest's.
    manifest = build_manifest(model, job_id="j", sequence=1, slot="main", model_id="cls", version="1")
    parsed = DeployManifest.model_validate({**manifest.model_dump(mode="json", exclude_none=True), **example})
    assert parsed.artifact("calibration").size == example["artifacts"][0]["size"]


def test_a_model_takes_a_handful_of_artifacts_and_an_agent_release_one_per_wheel(tmp_path: Path) -> None:
    """An agent release carries every wheel the agent runs from (a few dozen): its manifest may name
    up to MAX_RELEASE_WHEELS; a model's stays at MAX_ARTIFACTS."""
    document = tmp_path / "release.json"
    document.write_text("{}")
    wheels = []
    for index in range(MAX_ARTIFACTS + 1):
        wheel = tmp_path / f"dep{index}-1.0-py3-none-any.whl"
        wheel.write_bytes(f"wheel {index}".encode())
        wheels.append(describe_artifact(wheel, name=wheel.name, kind="wheel"))
    common: dict[str, Any] = {"job_id": "job-1", "sequence": 1, "model_id": "edge-agent", "version": "1"}
    release = build_manifest(document, slot="_agent", artifacts=wheels, **common)
    assert len(release.artifacts or ()) == MAX_ARTIFACTS + 1 <= MAX_RELEASE_WHEELS
    with pytest.raises(
        ValueError, match=f"artifacts: at most {MAX_ARTIFACTS} for a model, got {MAX_ARTIFACTS + 1}"
    ):
        build_manifest(document, slot="main", artifacts=wheels, **common)
