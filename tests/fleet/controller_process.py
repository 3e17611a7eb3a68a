"""A real ``edge-agent fleet controller`` process for tests (no tests here): started from a config
file, its console on a free port, its resident memory read with psutil, killed with a real signal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from agent.demo.broker import Broker, free_port
from agent.fleet.deploy.keys import KeyPairFiles
from tests.waiting import patient, wait_until

ROOT = Path(__file__).resolve().parents[2]


class ControllerProcess:
    """``python -m agent fleet controller --config FILE`` with ``extra`` YAML lines; console on;
    unsigned, or signing with ``keys`` (the operator's key the devices trust)."""

    def __init__(
        self, tmp_path: Path, broker: Broker, prefix: str, extra: str = "", keys: KeyPairFiles | None = None
    ) -> None:
        self.config = tmp_path / "controller.yaml"
        self.port = free_port()
        signing = "unsigned: true" if keys is None else f"signing_key: {keys.private}\nkey_id: {keys.key_id}"
        self.config.write_text(
            f"mqtt: {{host: {broker.host}, port: {broker.port}, prefix: {prefix}}}\n"
            f"state_dir: {tmp_path / 'state'}\n{signing}\n"
            f"http: {{port: {self.port}}}\n{extra}"
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / "controller.log"
        self.child: subprocess.Popen[bytes] | None = None

    def start(self) -> ControllerProcess:
        """Start it; returns once it printed its ready line (and so serves its console).

        The console's port was free when picked; another process of a parallel run may take it
        before the controller binds it (the controller then exits naming the port): a new port is
        picked and the start repeated, at most three times."""
        for _attempt in range(3):
            log = self._run()
            if b"Address already in use" not in log:
                break
            old, self.port = self.port, free_port()
            self.config.write_text(self.config.read_text().replace(f"port: {old}}}", f"port: {self.port}}}"))
            self.url = f"http://127.0.0.1:{self.port}"
        assert self.child is not None
        assert self.child.poll() is None, self.log.read_text()
        return self

    def _run(self) -> bytes:
        """Start the process; what it logged once it is ready or has exited."""
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        mark = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as out:
            child = self.child = subprocess.Popen(
                [sys.executable, "-m", "agent", "fleet", "controller", "--config", str(self.config)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        wait_until(
            lambda: b"requests on" in self.log.read_bytes()[mark:] or child.poll() is not None,
            timeout=60,
            what="the controller's ready line",
        )
        return self.log.read_bytes()[mark:] if child.poll() is not None else b""

    def rss(self) -> int:
        """The controller's resident memory now, in bytes."""
        assert self.child is not None
        return int(psutil.Process(self.child.pid).memory_info().rss)

    def get(self, path: str) -> tuple[int, bytes]:
        """GET ``path`` from its console: (status, body)."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=patient(30)) as response:
                return int(response.status), bytes(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, bytes(exc.read())

    def json(self, path: str) -> Any:
        status, body = self.get(path)
        assert status == 200, (path, status, body[:300])
        return json.loads(body)

    def kill(self) -> None:
        """SIGKILL: nothing is saved on the way out (what a crash or a power cut leaves)."""
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGKILL)
            self.child.wait(patient(10))
        self.child = None
