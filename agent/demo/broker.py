"""A private mosquitto: own config, own free loopback port, start/stop/kill/restart (demo, bench, tests).

Tests talk to a real broker (no fakes): this class writes a mosquitto config into a temporary
directory, runs ``mosquitto -c`` as a subprocess on a free loopback port and waits until the port
accepts connections. ``restart()`` keeps the port, so clients reconnect to the same address.

Ships with the package because ``edge-agent demo`` (and the benchmarks) start their own broker
with it; the tests use the same class.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

_START_TIMEOUT_S = 10.0


def mosquitto_binary() -> str:
    """Path of the mosquitto executable (Debian installs it in /usr/sbin, often not on PATH)."""
    found = shutil.which("mosquitto") or shutil.which("mosquitto", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        raise RuntimeError(
            "mosquitto not found: install it (apt-get install mosquitto) or run `make os-deps`"
        )
    return found


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def port_open(host: str, port: int) -> bool:
    """Whether something accepts TCP connections on ``host:port`` now."""
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


class Broker:
    """One mosquitto process listening on ``host:port`` (loopback only).

    ``extra_config`` lines are appended to the generated config, e.g. ``max_packet_size 4096`` or
    ``password_file /path``. A listener-scoped option must follow the listener line, which comes first.
    """

    host = "127.0.0.1"

    def __init__(self, workdir: Path, extra_config: Sequence[str] = (), port: int | None = None) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.extra_config = list(extra_config)
        self.port = port if port is not None else free_port()
        self._fixed_port = port is not None
        self.config_path = workdir / "mosquitto.conf"
        self.log_path = workdir / "mosquitto.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        """True while the mosquitto process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """Process id of the running broker, if any."""
        return self._proc.pid if self._proc is not None else None

    def _write_config(self) -> None:
        lines = [f"listener {self.port} {self.host}", "allow_anonymous true", "persistence false"]
        lines.append("set_tcp_nodelay true")  # small MQTT packets must not wait for delayed ACKs
        if os.geteuid() == 0:
            # Started as root, mosquitto drops to user `mosquitto`, which cannot read files in the
            # test's private temp directory (password file, certificates).
            lines.append("user root")
        lines += ["log_type error", "log_type warning", "log_type notice", "log_type information"]
        lines += self.extra_config
        self.config_path.write_text("\n".join(lines) + "\n")

    def start(self) -> None:
        """Start mosquitto and wait until the port accepts connections (a few tries on a port race)."""
        for attempt in range(5):
            self._write_config()
            with self.log_path.open("ab") as log:
                self._proc = subprocess.Popen(
                    [mosquitto_binary(), "-c", str(self.config_path)], stdout=log, stderr=subprocess.STDOUT
                )
            deadline = time.monotonic() + _START_TIMEOUT_S
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    break
                if port_open(self.host, self.port):
                    return
                time.sleep(0.02)
            self._reap()
            if self._fixed_port and attempt < 4:
                time.sleep(0.3)  # the old process may still hold the port for a moment
                continue
            if not self._fixed_port:
                self.port = free_port()
                continue
        raise RuntimeError(f"mosquitto did not start; log:\n{self.log_path.read_text(errors='replace')}")

    def _reap(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait(timeout=10)
        self._proc = None

    def stop(self) -> None:
        """Graceful stop (SIGTERM); waits for the process to exit."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._reap()

    def kill(self) -> None:
        """Abrupt stop (SIGKILL): clients see their TCP connection reset."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
        self._reap()

    def restart(self, *, hard: bool = False) -> None:
        """Stop (SIGKILL when ``hard``) and start again on the same port."""
        if hard:
            self.kill()
        else:
            self.stop()
        self._fixed_port = True
        self.start()

    def log(self) -> str:
        """The broker's log so far (useful in assertion messages)."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> Broker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
