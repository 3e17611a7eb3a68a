"""A real Prometheus (the OS package, installed by tools/os-deps.sh) for tests: scrapes given
loopback targets every second, stores in a temp dir, answers PromQL through its HTTP API."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.waiting import patient

#: Scrape interval of the test server: Prometheus marks a series stale when a scrape lacks it, so
#: a target's dropped series disappear from instant queries within about one interval.
SCRAPE_INTERVAL_S = 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    """``prometheus`` scraping ``targets`` (``host:port``, path /metrics); ``stop()`` kills it."""

    def __init__(
        self,
        workdir: Path,
        targets: list[str],
        rule_files: list[Path] | None = None,
        alertmanagers: list[str] | None = None,
    ) -> None:
        """``rule_files`` are evaluated every :data:`SCRAPE_INTERVAL_S`; firing alerts go to the
        ``alertmanagers`` (``host:port``)."""
        binary = shutil.which("prometheus") or "/usr/bin/prometheus"
        if not Path(binary).exists():
            pytest.skip("prometheus is not installed: run tools/os-deps.sh (make os-deps)")
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        config = workdir / "prometheus.yml"
        settings: dict[str, Any] = {
            "global": {
                "scrape_interval": f"{SCRAPE_INTERVAL_S}s",
                "scrape_timeout": "900ms",
                "evaluation_interval": f"{SCRAPE_INTERVAL_S}s",
            },
            "scrape_configs": [{"job_name": "edge", "static_configs": [{"targets": targets}]}],
        }
        if rule_files:
            settings["rule_files"] = [str(path) for path in rule_files]
        if alertmanagers:
            settings["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": alertmanagers}]}]}
        config.write_text(json.dumps(settings))  # JSON is YAML: no YAML writer needed
        self._log = (workdir / "prometheus.log").open("wb")
        self._process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.log_path = workdir / "prometheus.log"
        deadline = time.monotonic() + patient(30)
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{self.port}/-/ready", timeout=patient(1)
                ) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("prometheus did not become ready in 30 s")

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query's result vector: ``[{"metric": {labels}, "value": [ts, "text"]}, ...]``."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=patient(10)) as reply:
            body = json.loads(reply.read())
        if body.get("status") != "success":
            raise AssertionError(f"query {promql!r} failed: {body}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def targets_up(self) -> bool:
        """True once every target was scraped successfully at least once."""
        up = self.query("up")
        return bool(up) and all(r["value"][1] == "1" for r in up)

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait(patient(10))
        self._log.close()
