"""``fleet serve``: a repo's files are served by SHA-256 until the stop event, then it returns."""

from __future__ import annotations

import hashlib
import io
import json
import threading
from pathlib import Path

from agent.demo.broker import Broker
from agent.fleet.chunks.server import ChunkServer
from agent.fleet.cli.serve import serve_repo
from agent.protocol.topics import Topics
from tests.fleet.operator_side import operator_settings, tiny_model, unique_prefix
from tests.mqtt_probe import Probe
from tests.waiting import patient


def test_serves_repo_models_until_stopped(tmp_path: Path, broker: Broker) -> None:
    prefix = unique_prefix()
    model = tiny_model(tmp_path / "repo" / "net.onnx")
    data = model.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    stop, ready = threading.Event(), threading.Event()
    out = io.StringIO()
    result: list[ChunkServer] = []
    thread = threading.Thread(
        target=lambda: result.append(
            serve_repo(
                operator_settings(broker, prefix), tmp_path / "repo", stop, out=out, ready=ready, report_s=0
            )
        ),
        daemon=True,
    )
    thread.start()
    assert ready.wait(patient(10))
    topics = Topics(prefix, "jet-1")
    with Probe(broker.host, broker.port) as device:
        device.subscribe(topics.xfer_filter)
        request = {"sha256": sha, "indices": [1], "chunk_size": 1024, "device": "jet-1"}
        device.publish(
            topics.xfer_req, json.dumps(request), response_topic=topics.xfer(sha), correlation_data=b"r1"
        )
        reply = device.wait_for_count(topics.xfer(sha), 1, timeout=10)[0]
    stop.set()
    thread.join(patient(10))

    assert not thread.is_alive()
    assert reply.payload == data[1024:2048]
    assert reply.correlation_data == b"r1"
    assert result[0].stats()["chunks"] == 1
    text = out.getvalue()
    assert "serving 1 model files" in text
    assert "stopped; requests 1, chunks 1" in text
