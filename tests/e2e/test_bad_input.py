"""Every bad deployment input against one real daemon: a clear error each, and nothing else changes.

The daemon serves a file stream the whole time; afterwards every frame index has exactly one
result (no gap while bad manifests arrived), state.json still names the last good model, and
each bad manifest ended as a REJECTED job with its stable error code.
"""

from __future__ import annotations

import base64
import json
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from agent.demo.broker import Broker
from agent.demo.modelzoo import write_classifier
from agent.fleet.chunks.server import ChunkServer
from agent.mqtt.settings import MqttSettings
from agent.protocol.manifest import DeployManifest, build_manifest
from agent.protocol.messages import JobStatus, decode
from agent.signing import generate_keypair, private_key_from_bytes, sign
from tests.e2e.daemon import AgentFiles, Daemon, unique_results
from tests.mqtt_probe import Probe, Received
from tests.runtime.models import write_checker_failure

pytestmark = pytest.mark.slow


class CorruptsChunk0(ChunkServer):
    """A real server whose chunk 0 always arrives with a flipped byte."""

    def replies(self, index: int, data: bytes) -> list[tuple[int, bytes]]:
        return [(index, bytes([data[0] ^ 0xFF]) + data[1:])] if index == 0 else [(index, data)]


class NumbersOutOfRange(ChunkServer):
    """A real server that labels every chunk with an index past the end of the model."""

    def replies(self, index: int, data: bytes) -> list[tuple[int, bytes]]:
        return [(10_000 + index, data)]


class NeverAnswers(ChunkServer):
    """A real server that takes requests and never answers them."""

    def replies(self, index: int, data: bytes) -> list[tuple[int, bytes]]:
        return []


class BadHttp(BaseHTTPRequestHandler):
    """/missing: 404. /drop: promises the whole body, sends half, closes the connection."""

    body = b"x" * 20000

    def do_GET(self) -> None:
        if self.path == "/missing":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.send_header("ETag", '"v1"')
        self.end_headers()
        self.wfile.write(self.body[: len(self.body) // 2])
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, format: str, *args: object) -> None:
        pass


class Operator:
    """Publishes signed (or deliberately broken) manifests and serves their chunks."""

    def __init__(self, probe: Probe, server: ChunkServer, device: str, key: bytes) -> None:
        self.probe, self.server, self.device = probe, server, device
        self.key = private_key_from_bytes(key)
        self.sequence = 100
        self.models: dict[str, Path] = {}

    def manifest_on(self, server: ChunkServer, model: Path, job_id: str, **fields: Any) -> dict[str, Any]:
        """A manifest whose chunks only ``server`` answers (the model is unknown to the good server)."""
        m = self.manifest(model, job_id, **fields)
        server.register(DeployManifest.model_validate(m), model, verify=False)
        self.models.pop(job_id)
        return m

    def manifest(self, model: Path, job_id: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        m = build_manifest(
            model,
            job_id=job_id,
            sequence=self.sequence,
            slot="cls",
            model_id="cls",
            version=job_id,
            chunk_size=4096,
        )
        self.models[job_id] = model
        return {**json.loads(m.model_dump_json(exclude_none=True)), **fields}

    def publish(
        self,
        manifest: dict[str, Any] | None,
        *,
        raw: bytes | None = None,
        key_id: str = "k1",
        signer: Callable[[bytes], bytes] | None = None,
        signed: bool = True,
    ) -> None:
        if raw is None:
            assert manifest is not None
            self._serve(manifest)
            text = json.dumps(manifest)
            body: dict[str, Any] = {"manifest": text}
            if signed:
                signature = (signer or (lambda data: sign(self.key, data)))(text.encode())
                body |= {"key_id": key_id, "signature": base64.b64encode(signature).decode()}
            raw = json.dumps(body).encode()
        self.probe.publish(f"fleet/v1/{self.device}/down/desired/cls", raw, qos=1, retain=True)

    def _serve(self, manifest: dict[str, Any]) -> None:
        """Serve the chunks of what the manifest names, as it names them (even a wrong whole-file hash)."""
        try:
            parsed = DeployManifest.model_validate(manifest)
        except ValueError:
            return  # the device refuses it before asking for any chunk
        if parsed.job_id in self.models:
            self.server.register(parsed, self.models[parsed.job_id], verify=False)


def _jobs(messages: list[Received], device: str) -> dict[str, list[JobStatus]]:
    out: dict[str, list[JobStatus]] = {}
    for m in messages:
        if m.topic.startswith(f"fleet/v1/{device}/up/jobs/"):
            status = decode(JobStatus, m.payload)
            out.setdefault(status.job_id, []).append(status)
    return out


def _final(probe: Probe, device: str, job_id: str, timeout: float = 30) -> JobStatus:
    terminal = {"ACTIVE", "FAILED", "REJECTED", "ROLLED_BACK", "SUPERSEDED"}
    probe.wait_for(
        lambda ms: any(s.state.value in terminal for s in _jobs(ms, device).get(job_id, [])), timeout
    )
    return next(s for s in reversed(_jobs(probe.snapshot(), device)[job_id]) if s.state.value in terminal)


def test_bad_deployments_are_rejected_and_cost_nothing(tmp_path: Path, broker: Broker) -> None:
    device = f"bad-{uuid.uuid4().hex[:8]}"
    files = AgentFiles(tmp_path, broker.port, device, frames=30)
    private_pem, public_pem = generate_keypair()
    (tmp_path / "k1.pub").write_bytes(public_pem)
    stream = {"source": {"type": "file", "path": str(files.video), "loop": True, "realtime": True}}
    config = files.write_config(
        stream=stream,
        delivery={
            "trusted_keys": {"k1": str(tmp_path / "k1.pub")},
            "max_model_bytes": 2_000_000,
            "chunk_timeout_s": 0.5,
            "job_deadline_s": 4.0,
            "http_timeout_s": 2.0,
        },
    )
    results_topic = f"fleet/v1/{device}/up/results/cam"
    settings = MqttSettings(host=broker.host, port=broker.port)
    http = ThreadingHTTPServer(("127.0.0.1", 0), BadHttp)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    base_url = f"http://127.0.0.1:{http.server_address[1]}"
    # Each faulty server answers only for the model registered with it (a model of its own).
    odd = [
        write_classifier(tmp_path / f"odd-{i}.onnx", input_size=32, num_classes=4, seed=10 + i)
        for i in range(4)
    ]
    with (
        Probe(broker.host, broker.port) as probe,
        ChunkServer(settings, group=f"g-{device}") as server,
        CorruptsChunk0(settings, group=f"c-{device}") as corrupts,
        NumbersOutOfRange(settings, group=f"o-{device}") as misnumbers,
        NeverAnswers(settings, group=f"n-{device}") as silent,
    ):
        probe.subscribe(f"fleet/v1/{device}/up/#")
        op = Operator(probe, server, device, private_pem)
        daemon = Daemon(config, tmp_path / "agent.log")
        try:
            probe.wait_for_count(results_topic, 5, timeout=60)
            # A good deployment first, so that a replay has something to replay against.
            op.publish(op.manifest(files.v2, "good-1"))
            assert _final(probe, device, "good-1").state.value == "ACTIVE"

            big = write_classifier(tmp_path / "big.onnx", input_size=32, num_classes=4, seed=3, width=160)
            wrong_input = write_classifier(tmp_path / "in48.onnx", input_size=48, num_classes=4, seed=4)
            truncated = tmp_path / "truncated.onnx"
            truncated.write_bytes(files.v2.read_bytes()[: files.v2.stat().st_size // 2])
            checker = write_checker_failure(tmp_path / "checker.onnx", size=32, classes=4)

            def http_only(path: str) -> list[dict[str, str]]:
                return [{"kind": "http", "url": base_url + path}]

            cases: list[tuple[str, tuple[str, str], Callable[[str], None]]] = [
                (
                    "wrong-shape",
                    ("REJECTED", "bad_manifest"),
                    lambda j: op.publish({"job_id": j, "sequence": op.sequence + 1}),
                ),
                (
                    "bad-sig",
                    ("REJECTED", "bad_signature"),
                    lambda j: op.publish(op.manifest(files.v1, j), signer=lambda d: b"x" * 64),
                ),
                (
                    "unknown-key",
                    ("REJECTED", "unknown_key"),
                    lambda j: op.publish(op.manifest(files.v1, j), key_id="k9"),
                ),
                (
                    "unsigned",
                    ("REJECTED", "unsigned"),
                    lambda j: op.publish(op.manifest(files.v1, j), signed=False),
                ),
                (
                    "other-device",
                    ("REJECTED", "wrong_device"),
                    lambda j: op.publish(op.manifest(files.v1, j, device="someone-else")),
                ),
                (
                    "dotdot",
                    ("REJECTED", "bad_name"),
                    lambda j: op.publish(op.manifest(files.v1, j, model_id="../../etc")),
                ),
                (
                    "replay",
                    ("REJECTED", "replay"),
                    lambda j: op.publish({**op.manifest(files.v1, j), "sequence": 5}),
                ),
                ("too-large", ("REJECTED", "too_large"), lambda j: op.publish(op.manifest(big, j))),
                (
                    "hash",
                    ("REJECTED", "hash_mismatch"),
                    lambda j: op.publish(op.manifest(files.v1, j, sha256="0" * 64)),
                ),
                ("truncated", ("REJECTED", "bad_onnx"), lambda j: op.publish(op.manifest(truncated, j))),
                ("checker", ("REJECTED", "onnx_checker"), lambda j: op.publish(op.manifest(checker, j))),
                ("input48", ("REJECTED", "incompatible"), lambda j: op.publish(op.manifest(wrong_input, j))),
                (
                    "corrupt-chunk",
                    ("FAILED", "transfer_timeout"),
                    lambda j: op.publish(op.manifest_on(corrupts, odd[0], j)),
                ),
                (
                    "chunk-index",
                    ("FAILED", "transfer_timeout"),
                    lambda j: op.publish(op.manifest_on(misnumbers, odd[1], j)),
                ),
                (
                    "no-answer",
                    ("FAILED", "transfer_timeout"),
                    lambda j: op.publish(op.manifest_on(silent, odd[2], j)),
                ),
                (
                    "http-404",
                    ("FAILED", "http_not_found"),
                    lambda j: op.publish(op.manifest(odd[3], j, sources=http_only("/missing"))),
                ),
                (
                    "http-drop",
                    ("FAILED", "http_failed"),
                    lambda j: op.publish(op.manifest(odd[3], j, sources=http_only("/drop"))),
                ),
            ]
            assert big.stat().st_size > 2_000_000
            codes = {}
            for job_id, _expected, send in cases:
                send(job_id)
                final = _final(probe, device, job_id)
                codes[job_id] = (final.state.value, final.error_code, final.error)
            # A job that failed for want of chunks is retryable: a new manifest for the same model.
            op.publish(op.manifest(odd[2], "retry"))
            assert _final(probe, device, "retry").state.value == "ACTIVE"
            # Malformed JSON has no job id to report on: it is logged, and nothing changes.
            op.publish(None, raw=b"{not json")
            daemon.wait_for_event("delivery.manifest.rejected", timeout=10)
            count = len(probe.on_topic(results_topic))
            probe.wait_for_count(results_topic, count + 10, timeout=30)
        finally:
            code = daemon.stop()
            http.shutdown()
    assert code == 0, daemon.log()[-3000:]
    for job_id, expected, _send in cases:
        state, error_code, error = codes[job_id]
        assert (state, error_code) == expected, (job_id, error)
        assert error
    results = unique_results(probe.snapshot(), results_topic)
    assert [r.frame_index for r in results] == list(range(len(results))), "results had a gap"
    assert {r.model.version for r in results} <= {"1", "good-1", "retry"}
    assert results[-1].model.version == "retry"
    state = json.loads((tmp_path / "state" / "state.json").read_text())
    assert state["slots"]["cls"]["active"]["version"] == "retry"
    assert state["slots"]["cls"]["last_known_good"]["version"] == "good-1"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 8 MiB filesystem (tmpfs) for the agent's state directory; needs root to mount."""
    mount_point = tmp_path / "small-disk"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount_point)],
        check=False,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): the disk-full case needs root")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_a_model_larger_than_the_free_disk_is_refused_before_download(
    tmp_path: Path, broker: Broker, small_disk: Path
) -> None:
    device = f"disk-{uuid.uuid4().hex[:8]}"
    files = AgentFiles(tmp_path / "files", broker.port, device, frames=30)
    private_pem, public_pem = generate_keypair()
    (tmp_path / "k1.pub").write_bytes(public_pem)
    stream = {"source": {"type": "file", "path": str(files.video), "loop": True, "realtime": True}}
    config = files.write_config(
        stream=stream,
        state_dir=str(small_disk / "state"),
        delivery={"trusted_keys": {"k1": str(tmp_path / "k1.pub")}, "disk_headroom_bytes": 0},
    )
    huge = write_classifier(tmp_path / "huge.onnx", input_size=32, num_classes=4, seed=5, width=200)
    assert huge.stat().st_size > 8 * 1024 * 1024
    results_topic = f"fleet/v1/{device}/up/results/cam"
    settings = MqttSettings(host=broker.host, port=broker.port)
    with Probe(broker.host, broker.port) as probe, ChunkServer(settings, group=f"g-{device}") as server:
        probe.subscribe(f"fleet/v1/{device}/up/#")
        op = Operator(probe, server, device, private_pem)
        daemon = Daemon(config, tmp_path / "agent.log")
        try:
            probe.wait_for_count(results_topic, 5, timeout=60)
            state_before = (small_disk / "state" / "state.json").read_text()
            op.publish(op.manifest(huge, "too-big-for-disk"))
            final = _final(probe, device, "too-big-for-disk")
            count = len(probe.on_topic(results_topic))
            probe.wait_for_count(results_topic, count + 10, timeout=30)
        finally:
            code = daemon.stop()
    assert code == 0
    assert (final.state.value, final.error_code) == ("FAILED", "disk_full")
    assert final.error is not None
    assert "free" in final.error
    assert server.served_bytes() == 0  # refused before a single chunk was asked for
    results = unique_results(probe.snapshot(), results_topic)
    assert [r.frame_index for r in results] == list(range(len(results)))
    assert {r.model.version for r in results} == {"1"}
    assert json.loads((small_disk / "state" / "state.json").read_text()) == json.loads(state_before)
