"""A real Alertmanager (the OS package, installed by tools/os-deps.sh) for tests, and a webhook
receiver: a real local HTTP server that keeps what Alertmanager POSTs to it."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from agent.demo.broker import free_port
from tests.waiting import patient


def alertmanager_binary() -> str:
    """Debian names the binary prometheus-alertmanager; upstream's tarball, alertmanager."""
    found = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    if found is None:
        pytest.skip("Alertmanager is not installed: run tools/os-deps.sh test (make os-deps)")
    return found


class Alertmanager:
    """``prometheus-alertmanager`` with ``config_text`` as its configuration, on a free loopback
    port, its storage in ``workdir``, clustering off; ``stop()`` kills it."""

    def __init__(self, workdir: Path, config_text: str) -> None:
        binary = alertmanager_binary()
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / "alertmanager.yml"
        config.write_text(config_text, encoding="utf-8")
        self.port = free_port()
        self.log_path = workdir / "alertmanager.log"
        self._log = self.log_path.open("wb")
        self._process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--cluster.listen-address=",  # no gossip port: one instance, nothing to peer with
                "--log.level=warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + patient(60)
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                self._log.close()
                raise RuntimeError(f"alertmanager exited: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{self.port}/-/ready", timeout=patient(1)
                ) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("alertmanager did not become ready in 60 s")

    @property
    def address(self) -> str:
        """``host:port``, as Prometheus' alerting configuration takes it."""
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait(patient(10))
        self._log.close()


class WebhookReceiver:
    """An HTTP server on a free loopback port keeping every JSON body POSTed to it (Alertmanager's
    webhook payloads); ``alerts()`` flattens them, ``stop()`` shuts it down."""

    def __init__(self, path: str = "/alerts") -> None:
        self.path = path
        self.posts: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length))
                with receiver._lock:
                    receiver.posts.append({"path": self.path, **body})
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="webhook", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}{self.path}"

    def alerts(self) -> list[dict[str, Any]]:
        """Every alert of every POST so far, in arrival order."""
        with self._lock:
            return [alert for post in self.posts for alert in post.get("alerts", [])]

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(patient(5.0))
