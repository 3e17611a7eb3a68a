"""A manifest artifact with a ``url``: fetched over HTTP by the same fetch path as a model, verified the
same way, from a real HTTP server (tests/delivery/transfer/test_http_source.py's)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from agent.delivery.settings import DeliveryConfig
from agent.delivery.transfer.pull import fetch_model
from agent.demo.modelzoo import write_classifier
from agent.model_contract.calibration_table import write_table
from agent.protocol.delivery_errors import NoSourceError
from agent.protocol.manifest import build_manifest, describe_artifact
from agent.protocol.topics import Topics
from agent.specs.build import BuildSpec, CalibrationSource
from tests.delivery.transfer.test_http_source import ModelServer

SPEC = BuildSpec(
    precision="int8", device="cpu", calibration=CalibrationSource(kind="cache", artifact="calib")
)


def test_an_artifact_is_fetched_from_its_url_and_other_bytes_there_are_refused(tmp_path: Path) -> None:
    model = write_classifier(tmp_path / "m.onnx", input_size=32, seed=4)
    table = tmp_path / "calibration.json"
    write_table(table, {f"t{i}": (-1.0, float(i)) for i in range(100)}, method="entropy")
    server = ModelServer(table.read_bytes())
    try:
        artifact = describe_artifact(table, name="calib", kind="calibration", chunk_size=1024, url=server.url)
        manifest = build_manifest(
            model,
            job_id="j",
            sequence=1,
            slot="main",
            model_id="cls",
            version="1",
            build=SPEC,
            artifacts=[artifact],
        )
        view = manifest.for_artifact(artifact)
        assert [s.kind for s in view.sources] == ["http", "mqtt"]

        def fetch(part_dir: Path) -> Path:
            return fetch_model(
                view,
                part_dir,
                lambda done, total: None,
                threading.Event(),
                link=None,
                topics=Topics("fleet/v1", "d1"),
                config=DeliveryConfig(),
            )

        assert fetch(tmp_path / "partial").read_bytes() == table.read_bytes()
        assert len(server.behaviour.requests) >= 1
        # Another file at the url: no chunk matches the signed hashes, and (no MQTT link here) the
        # fetch fails naming the missing source instead of handing the build wrong bytes.
        server.behaviour.data = model.read_bytes()[: table.stat().st_size]
        with pytest.raises(NoSourceError):
            fetch(tmp_path / "partial-2")
    finally:
        server.close()
