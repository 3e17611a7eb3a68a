"""A manifest's calibration artifact on a real DeliveryService: fetched, verified, handed to the build.

Real mosquitto, a real in-process device (tests/delivery/delivery_stack.py) whose fetch copies files
by SHA-256 (the MQTT pull itself is tests/delivery/transfer/test_transfer.py's subject: artifacts use it
unchanged through ``DeployManifest.for_artifact``).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from agent.delivery.jobs.artifacts import KEEP, fetch_artifacts
from agent.delivery.jobs.steps import BuildOutcome, JobReporter, no_build
from agent.model_contract.calibration_table import write_table
from agent.protocol.manifest import DeployManifest, build_manifest, describe_artifact
from agent.protocol.messages import JobState
from agent.specs.build import BuildSpec, CalibrationSource
from agent.store import ModelStore
from tests.delivery.conftest import HarnessFactory

SPEC = BuildSpec(
    precision="int8", device="cpu", calibration=CalibrationSource(kind="cache", artifact="calib")
)


class RecordingBuild:
    """The default build (the ONNX model as is), remembering the spec each job asked for."""

    def __init__(self) -> None:
        self.specs: list[BuildSpec | None] = []

    def __call__(self, model: Path, spec: BuildSpec | None, reporter: JobReporter) -> BuildOutcome:
        self.specs.append(spec)
        return no_build(model, spec, reporter)


def table_at(path: Path, top: float) -> Path:
    write_table(path, {f"t{i}": (-1.0, top + i) for i in range(100)}, method="entropy")
    return path


def test_the_build_gets_the_fetched_and_verified_calibration_file(
    make_device: HarnessFactory, model_v1: Path, tmp_path: Path
) -> None:
    build = RecordingBuild()
    device = make_device(build=build)
    table = table_at(tmp_path / "calibration.json", 1.0)
    artifact = describe_artifact(table, name="calib", kind="calibration", chunk_size=1024)
    device.repo.files[artifact.sha256] = table
    manifest = device.manifest(model_v1, build=SPEC, artifacts=[artifact])
    device.deploy(device.signed(manifest))
    assert device.wait_terminal(manifest.job_id)[-1].state is JobState.ACTIVE
    spec = build.specs[-1]
    assert spec is not None
    assert spec.calibration is not None
    assert spec.calibration.artifact is None
    assert spec.calibration.path == device.state_dir / "artifacts" / f"{artifact.sha256}.onnx"
    assert spec.calibration.path.read_bytes() == table.read_bytes()
    # A second job with the same calibration fetches only the model.
    again = device.manifest(model_v1, sequence=2, version="2", build=SPEC, artifacts=[artifact])
    fetched = len(device.repo.fetched)
    device.deploy(device.signed(again))
    assert device.wait_terminal(again.job_id)[-1].state is JobState.ACTIVE
    assert len(device.repo.fetched) == fetched  # the model is stored too: nothing fetched at all


def test_calibration_bytes_that_do_not_match_the_signed_hash_fail_the_job_before_any_build(
    make_device: HarnessFactory, model_v1: Path, tmp_path: Path
) -> None:
    build = RecordingBuild()
    device = make_device(build=build)
    table = table_at(tmp_path / "calibration.json", 1.0)
    artifact = describe_artifact(table, name="calib", kind="calibration", chunk_size=1024)
    # Whoever serves the artifact's hash hands over other bytes.
    device.repo.files[artifact.sha256] = table_at(tmp_path / "other.json", 5.0)
    manifest = device.manifest(model_v1, build=SPEC, artifacts=[artifact])
    device.deploy(device.signed(manifest))
    final = device.wait_terminal(manifest.job_id)[-1]
    assert (final.state, final.error_code) == (JobState.REJECTED, "hash_mismatch"), final
    assert final.error is not None
    assert final.error.startswith("artifact 'calib'"), final.error
    assert build.specs == []
    assert not (device.state_dir / "artifacts" / f"{artifact.sha256}.onnx").exists()


def test_cleanup_keeps_the_calibration_a_running_engine_was_built_with(
    make_device: HarnessFactory, model_v1: Path, tmp_path: Path
) -> None:
    """Only the newest KEEP artifacts stay (besides the job's own), but never one the slots still
    name (their active or last-known-good engine was built with it: a rollback may rebuild from it)."""
    protected: set[str] = set()
    device = make_device(protect=lambda: set(protected))
    artifacts = []
    for sequence in range(1, KEEP + 4):
        table = table_at(tmp_path / f"calibration-{sequence}.json", float(sequence))
        artifact = describe_artifact(table, name="calib", kind="calibration", chunk_size=1024)
        device.repo.files[artifact.sha256] = table
        manifest = device.manifest(
            model_v1, sequence=sequence, version=str(sequence), build=SPEC, artifacts=[artifact]
        )
        device.deploy(device.signed(manifest))
        assert device.wait_terminal(manifest.job_id)[-1].state is JobState.ACTIVE
        artifacts.append(artifact)
        if sequence == 1:
            protected.add(artifact.sha256)  # the first job's engine stays the slot's rollback target

    kept = {path.name.removesuffix(".onnx") for path in (device.state_dir / "artifacts").glob("*.onnx")}
    assert len(kept) == KEEP + 2  # the last job's, the KEEP newest before it, the protected one
    assert artifacts[0].sha256 in kept
    assert artifacts[1].sha256 not in kept  # the oldest unprotected one went
    assert {a.sha256 for a in artifacts[-KEEP:]} <= kept


class RecordingFetch:
    """A fetch that copies the file its manifest names by SHA-256 into the part dir, remembering each
    call (the transfer itself is tests/delivery/transfer's subject)."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files
        self.asked: list[str] = []

    def __call__(
        self, manifest: DeployManifest, part_dir: Path, progress: Any, cancel: threading.Event
    ) -> Path:
        del progress, cancel
        self.asked.append(manifest.sha256)
        part = part_dir / f"{manifest.sha256}.part"
        part.write_bytes(self.files[manifest.sha256].read_bytes())
        return part


def test_artifacts_a_device_target_holds_are_neither_fetched_nor_returned(tmp_path: Path) -> None:
    wheels = []
    for name, body in (
        ("edge_agent-0.4.0-py3-none-any.whl", b"new"),
        ("numpy-1.26.4-py3-none-any.whl", b"kept"),
    ):
        path = tmp_path / name
        path.write_bytes(os.urandom(3000) + body)
        wheels.append(describe_artifact(path, name=name, kind="wheel", chunk_size=1024))
    ours, shared = wheels
    document = tmp_path / "release.json"
    document.write_text("{}")
    manifest = build_manifest(
        document,
        job_id="agent-1",
        sequence=1,
        slot="_agent",
        model_id="edge-agent",
        version="0.4.0",
        chunk_size=4096,
        artifacts=wheels,
    )
    store = ModelStore(tmp_path / "artifacts")
    fetch = RecordingFetch({a.sha256: tmp_path / a.name for a in wheels})
    paths = fetch_artifacts(
        manifest,
        store,
        fetch=fetch,
        part_dir=tmp_path / "partial",
        cancel=threading.Event(),
        max_bytes=1 << 20,
        held={shared.sha256},
    )
    assert fetch.asked == [ours.sha256]  # the held wheel is not asked for
    assert set(paths) == {ours.name}
    assert paths[ours.name].read_bytes() == (tmp_path / ours.name).read_bytes()
    assert not store.has(shared.sha256)

    # Nothing held: both fetched, the stored one only touched on a second job.
    again = fetch_artifacts(
        manifest,
        store,
        fetch=fetch,
        part_dir=tmp_path / "partial",
        cancel=threading.Event(),
        max_bytes=1 << 20,
    )
    assert fetch.asked == [ours.sha256, shared.sha256]
    assert set(again) == {ours.name, shared.name}
    assert store.has(shared.sha256)
