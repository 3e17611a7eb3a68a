"""HttpSource against a real ThreadingHTTPServer on 127.0.0.1 that speaks Range / If-Range.

Server variants (set per test on the ModelServer): 404, drop the connection mid-body (once, or
every time before any byte), ignore Range, change the ETag between requests, answer 503 once,
serve another file.
"""

from __future__ import annotations

import http.server
import re
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agent.delivery.transfer.http_source import HttpSource
from agent.delivery.transfer.partial import PartialDownload
from agent.delivery.transfer.pull import fetch_model
from agent.protocol.delivery_errors import HttpFailedError, HttpNotFoundError, JobCancelledError
from agent.protocol.manifest import DeployManifest, ModelSourceRef
from agent.protocol.topics import Topics
from tests.delivery.transfer.transfer_rig import KIB, delivery_config, manifest_for, random_model

CHUNK = 16 * KIB
SIZE = 20 * CHUNK + 777


@dataclass
class Behaviour:
    """What the server does; every field can be changed by a test."""

    data: bytes = b""
    not_found: bool = False
    drop_once_after: int | None = None  # first response: close after this many body bytes
    drop_always: bool = False  # every response: headers, then close before any body byte
    ignore_range: bool = False
    etag_per_request: bool = False  # the ETag changes every time (as if the file were replaced)
    unavailable_once: bool = False
    requests: list[dict[str, str]] = field(default_factory=list)
    body_bytes: int = 0


class _Handler(http.server.BaseHTTPRequestHandler):
    behaviour: Behaviour

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        b = self.server.behaviour  # type: ignore[attr-defined]
        b.requests.append(dict(self.headers.items()))
        if b.not_found:
            self.send_error(404)
            return
        if b.unavailable_once:
            b.unavailable_once = False
            self.send_error(503)
            return
        etag = f'"v{len(b.requests)}"' if b.etag_per_request else '"v1"'
        start = 0
        match = re.match(r"bytes=(\d+)-$", self.headers.get("Range", ""))
        if_range = self.headers.get("If-Range")
        if match and not b.ignore_range and (if_range is None or if_range == etag):
            start = int(match.group(1))
        body = b.data[start:]
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(b.data) - 1}/{len(b.data)}")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("ETag", etag)
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        cut: int | None = None
        if b.drop_always:
            cut = 0
        elif b.drop_once_after is not None:
            cut, b.drop_once_after = b.drop_once_after, None
        if cut is not None:
            self.wfile.write(body[:cut])
            b.body_bytes += cut
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)  # the connection drops mid-body
            self.close_connection = True
            return
        self.wfile.write(body)
        b.body_bytes += len(body)


class ModelServer:
    def __init__(self, data: bytes) -> None:
        self.behaviour = Behaviour(data=data)
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.behaviour = self.behaviour  # type: ignore[attr-defined]
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/models/m.onnx"
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return random_model(tmp_path / "src" / "m.onnx", SIZE)


@pytest.fixture
def manifest(model: Path) -> DeployManifest:
    return manifest_for(model, CHUNK)


@pytest.fixture
def server(model: Path) -> Iterator[ModelServer]:
    s = ModelServer(model.read_bytes())
    yield s
    s.close()


def download(
    tmp_path: Path, manifest: DeployManifest, source: HttpSource, progress: list[int] | None = None
) -> Path:
    with PartialDownload(tmp_path / "partial", manifest) as partial:
        source.fetch(partial, (lambda done, total: progress.append(done)) if progress is not None else None)
        return partial.finish()


def test_a_plain_download_without_range(
    tmp_path: Path, model: Path, manifest: DeployManifest, server: ModelServer
) -> None:
    progress: list[int] = []
    path = download(tmp_path, manifest, HttpSource(server.url, timeout_s=5), progress)

    assert path.read_bytes() == model.read_bytes()
    assert len(server.behaviour.requests) == 1
    assert "Range" not in server.behaviour.requests[0]
    assert progress[-1] == SIZE
    assert progress == sorted(progress)


def test_a_connection_dropped_mid_body_resumes_with_range_and_if_range(
    tmp_path: Path, model: Path, manifest: DeployManifest, server: ModelServer
) -> None:
    server.behaviour.drop_once_after = 5 * CHUNK + 100  # five whole chunks, then a torn one
    source = HttpSource(server.url, timeout_s=5, retry_delay_s=0.01)

    path = download(tmp_path, manifest, source)

    assert path.read_bytes() == model.read_bytes()
    first, second = server.behaviour.requests
    assert "Range" not in first
    assert second["Range"] == f"bytes={5 * CHUNK}-"
    assert second["If-Range"] == '"v1"'
    assert source.restarts == 0
    # Only the torn chunk's 100 bytes were sent twice.
    assert server.behaviour.body_bytes == SIZE + 100


def test_a_server_that_ignores_range_restarts_from_zero(
    tmp_path: Path, model: Path, manifest: DeployManifest, server: ModelServer
) -> None:
    server.behaviour.drop_once_after = 3 * CHUNK
    server.behaviour.ignore_range = True
    source = HttpSource(server.url, timeout_s=5, retry_delay_s=0.01)

    path = download(tmp_path, manifest, source)

    assert path.read_bytes() == model.read_bytes()
    assert len(server.behaviour.requests) == 2
    assert source.restarts == 1


def test_a_changed_validator_gets_the_whole_file_again(
    tmp_path: Path, model: Path, manifest: DeployManifest, server: ModelServer
) -> None:
    server.behaviour.drop_once_after = 2 * CHUNK
    server.behaviour.etag_per_request = True  # If-Range "v1" no longer matches: 200, whole body
    source = HttpSource(server.url, timeout_s=5, retry_delay_s=0.01)

    path = download(tmp_path, manifest, source)

    assert path.read_bytes() == model.read_bytes()
    assert server.behaviour.requests[1]["If-Range"] == '"v1"'
    assert source.restarts == 1


def test_404_fails_at_once_with_http_not_found(
    tmp_path: Path, manifest: DeployManifest, server: ModelServer
) -> None:
    server.behaviour.not_found = True

    with pytest.raises(HttpNotFoundError) as caught:
        download(tmp_path, manifest, HttpSource(server.url, timeout_s=5))

    assert caught.value.code == "http_not_found"
    assert server.url in str(caught.value)
    assert len(server.behaviour.requests) == 1


def test_a_server_that_always_drops_fails_after_bounded_retries(
    tmp_path: Path, manifest: DeployManifest, server: ModelServer
) -> None:
    server.behaviour.drop_always = True
    source = HttpSource(server.url, timeout_s=5, max_attempts=3, retry_delay_s=0.01)

    with pytest.raises(HttpFailedError) as caught:
        download(tmp_path, manifest, source)

    assert caught.value.code == "http_failed"
    assert "3 times in a row" in str(caught.value)
    assert len(server.behaviour.requests) == 3


def test_a_503_is_retried(tmp_path: Path, model: Path, manifest: DeployManifest, server: ModelServer) -> None:
    server.behaviour.unavailable_once = True

    path = download(tmp_path, manifest, HttpSource(server.url, timeout_s=5, retry_delay_s=0.01))

    assert path.read_bytes() == model.read_bytes()
    assert len(server.behaviour.requests) == 2


def test_another_file_at_the_url_is_refused(
    tmp_path: Path, manifest: DeployManifest, server: ModelServer
) -> None:
    server.behaviour.data = bytes(SIZE)  # right size, wrong bytes

    with pytest.raises(HttpFailedError, match="chunk 0 does not match"):
        download(tmp_path, manifest, HttpSource(server.url, timeout_s=5))

    with PartialDownload(tmp_path / "partial", manifest) as partial:
        assert partial.bytes_done == 0


def test_cancel_stops_between_chunks(tmp_path: Path, manifest: DeployManifest, server: ModelServer) -> None:
    cancel = threading.Event()
    source = HttpSource(server.url, timeout_s=5, cancel=cancel)
    with PartialDownload(tmp_path / "partial", manifest) as partial:

        def progress(done: int, total: int) -> None:
            if done >= 3 * CHUNK:
                cancel.set()

        with pytest.raises(JobCancelledError):
            source.fetch(partial, progress)
        assert partial.bytes_done == 3 * CHUNK


def test_http_resumes_what_another_attempt_left(
    tmp_path: Path, model: Path, manifest: DeployManifest, server: ModelServer
) -> None:
    data = model.read_bytes()
    with PartialDownload(tmp_path / "partial", manifest) as partial:
        for index in (0, 1, 2, 4):  # e.g. an earlier MQTT pull
            partial.write_chunk(index, data[index * CHUNK : (index + 1) * CHUNK])

    path = download(tmp_path, manifest, HttpSource(server.url, timeout_s=5))

    assert path.read_bytes() == data
    assert server.behaviour.requests[0]["Range"] == f"bytes={3 * CHUNK}-"


def test_fetch_model_uses_an_http_source_without_mqtt(
    tmp_path: Path, model: Path, model_server_manifest: tuple[DeployManifest, ModelServer]
) -> None:
    manifest, _ = model_server_manifest
    path = fetch_model(
        manifest,
        tmp_path / "partial",
        lambda done, total: None,
        threading.Event(),
        link=None,
        topics=Topics("fleet/v1", "dev-http"),
        config=delivery_config(),
    )
    assert path.read_bytes() == model.read_bytes()


def test_fetch_model_falls_through_a_404_source_to_the_next_url(
    tmp_path: Path, model: Path, server: ModelServer
) -> None:
    missing = ModelServer(b"")
    missing.behaviour.not_found = True
    try:
        sources = [ModelSourceRef(kind="http", url=missing.url), ModelSourceRef(kind="http", url=server.url)]
        manifest = manifest_for(model, CHUNK, sources=sources)
        path = fetch_model(
            manifest,
            tmp_path / "partial",
            lambda done, total: None,
            threading.Event(),
            link=None,
            topics=Topics("fleet/v1", "dev-http"),
            config=delivery_config(),
        )
    finally:
        missing.close()
    assert path.read_bytes() == model.read_bytes()
    assert len(missing.behaviour.requests) == 1


@pytest.fixture
def model_server_manifest(model: Path, server: ModelServer) -> tuple[DeployManifest, ModelServer]:
    return manifest_for(model, CHUNK, sources=[ModelSourceRef(kind="http", url=server.url)]), server
