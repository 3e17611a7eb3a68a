"""sd_notify over a real AF_UNIX datagram socket, the liveness-gated watchdog, and the unit file."""

from __future__ import annotations

import configparser
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from agent.watchdog.systemd import Heartbeat, Notifier, Watchdog
from tests.unit_files import analyze_verify
from tests.unit_files import read_unit as read_unit_file
from tests.waiting import patient, wait_until

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "systemd" / "edge-agent.service"


class NotifySocket:
    """A bound AF_UNIX SOCK_DGRAM socket standing in for systemd's notification socket."""

    def __init__(self, address: str | bytes, env_value: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.env_value = env_value

    def recv(self, timeout: float = 10.0) -> str:
        self.sock.settimeout(patient(timeout))
        return self.sock.recv(4096).decode()

    def pending(self) -> list[str]:
        """Every datagram already queued, without waiting."""
        out = []
        self.sock.setblocking(False)
        try:
            while True:
                out.append(self.sock.recv(4096).decode())
        except BlockingIOError:
            return out
        finally:
            self.sock.setblocking(True)

    def env(self, **extra: str) -> dict[str, str]:
        return {"NOTIFY_SOCKET": self.env_value, **extra}


@pytest.fixture
def notify_socket() -> Iterator[NotifySocket]:
    # A short directory: AF_UNIX paths are limited to 107 bytes and pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="sdn") as d:
        path = os.path.join(d, "notify")
        s = NotifySocket(path, path)
        yield s
        s.sock.close()


@pytest.fixture
def abstract_socket() -> Iterator[NotifySocket]:
    name = f"edge-agent-test-{uuid.uuid4().hex}"
    s = NotifySocket(b"\0" + name.encode(), "@" + name)
    yield s
    s.sock.close()


# --- Notifier ---------------------------------------------------------------------------------


def test_notifications_arrive_on_a_filesystem_socket(notify_socket: NotifySocket) -> None:
    n = Notifier.from_env(notify_socket.env())
    assert n.enabled
    assert n.ready("serving 2 streams")
    assert notify_socket.recv() == "READY=1\nSTATUS=serving 2 streams"
    assert n.ready()
    assert notify_socket.recv() == "READY=1"
    assert n.status("building engine\nfor slot default")
    assert notify_socket.recv() == "STATUS=building engine for slot default"
    assert n.watchdog()
    assert notify_socket.recv() == "WATCHDOG=1"
    assert n.extend_timeout(90)
    assert notify_socket.recv() == "EXTEND_TIMEOUT_USEC=90000000"
    assert n.extend_timeout(0.25)
    assert notify_socket.recv() == "EXTEND_TIMEOUT_USEC=250000"
    assert n.stopping()
    assert notify_socket.recv() == "STOPPING=1"
    n.close()


def test_reloading_carries_monotonic_usec(notify_socket: NotifySocket) -> None:
    n = Notifier.from_env(notify_socket.env())
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert n.reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    first, second = notify_socket.recv().split("\n")
    assert first == "RELOADING=1"
    key, value = second.split("=")
    assert key == "MONOTONIC_USEC"
    assert before <= int(value) <= after


def test_abstract_socket_address(abstract_socket: NotifySocket) -> None:
    n = Notifier.from_env(abstract_socket.env())
    assert n.ready("abstract")
    assert abstract_socket.recv() == "READY=1\nSTATUS=abstract"


def test_without_notify_socket_everything_is_a_no_op() -> None:
    n = Notifier.from_env({})
    assert not n.enabled
    assert not n.ready("x")
    assert not n.status("x")
    assert not n.watchdog()
    assert not n.stopping()
    assert not n.reloading()
    assert not n.extend_timeout(5)
    assert n.watchdog_interval_s() is None
    assert not Watchdog(n, threading.Event()).start()


def test_send_failure_returns_false_and_is_logged(tmp_path: Path) -> None:
    n = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")})
    with capture_logs() as logs:
        assert not n.ready()
    assert [e["event"] for e in logs] == ["systemd.notify.failed"]


def test_unsupported_socket_scheme_disables_notifications() -> None:
    with capture_logs() as logs:
        n = Notifier.from_env({"NOTIFY_SOCKET": "vsock:2:1234"})
    assert not n.enabled
    assert [e["event"] for e in logs] == ["systemd.notify.unsupported_socket"]


def test_watchdog_interval_from_environment() -> None:
    assert Notifier.from_env({"WATCHDOG_USEC": "30000000"}).watchdog_interval_s() == 30.0
    mine = {"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}
    assert Notifier.from_env(mine).watchdog_interval_s() == 30.0
    inherited = {"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}
    assert Notifier.from_env(inherited).watchdog_interval_s() is None
    assert Notifier.from_env({"WATCHDOG_USEC": "0"}).watchdog_interval_s() is None
    assert Notifier.from_env({"WATCHDOG_USEC": "soon"}).watchdog_interval_s() is None


def test_unset_environment_hides_the_socket_from_children(
    notify_socket: NotifySocket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", notify_socket.env_value)
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    n = Notifier.from_env(unset_environment=True)
    assert "NOTIFY_SOCKET" not in os.environ
    assert "WATCHDOG_USEC" not in os.environ
    assert n.watchdog_interval_s() == 1.0
    assert n.ready()
    assert notify_socket.recv() == "READY=1"


# --- Watchdog ---------------------------------------------------------------------------------


def test_watchdog_tick_pings_only_when_every_check_passes(notify_socket: NotifySocket) -> None:
    n = Notifier.from_env(notify_socket.env())
    link_up = threading.Event()
    link_up.set()
    wd = Watchdog(n, threading.Event(), interval_s=30)
    wd.add_check("frame_loop", lambda: True)
    wd.add_check("mqtt_link", link_up.is_set)
    assert wd.tick()
    assert notify_socket.recv() == "WATCHDOG=1"

    link_up.clear()
    with capture_logs() as logs:
        assert not wd.tick()
    assert notify_socket.pending() == []
    [withheld] = logs
    assert withheld["event"] == "systemd.watchdog.withheld"
    assert withheld["failing"] == ["mqtt_link"]
    assert (wd.pings, wd.withheld) == (1, 1)


def test_a_raising_check_counts_as_failing(notify_socket: NotifySocket) -> None:
    def broken() -> bool:
        raise RuntimeError("heartbeat object gone")

    wd = Watchdog(Notifier.from_env(notify_socket.env()), threading.Event(), interval_s=30)
    wd.add_check("broken", broken)
    with capture_logs() as logs:
        assert not wd.tick()
    assert [e["event"] for e in logs] == ["systemd.watchdog.check_raised", "systemd.watchdog.withheld"]
    assert notify_socket.pending() == []


def test_heartbeat_check_goes_stale() -> None:
    hb = Heartbeat()
    assert hb.fresher_than(60)()
    assert not hb.fresher_than(-1)()  # any age is older than a negative limit
    hb.beat()
    assert hb.age_s() >= 0


def test_watchdog_thread_withholds_pings_while_a_check_fails(notify_socket: NotifySocket) -> None:
    # WATCHDOG_USEC of 0.2 s: pings every 0.1 s.
    env = notify_socket.env(WATCHDOG_USEC="200000", WATCHDOG_PID=str(os.getpid()))
    stop = threading.Event()
    healthy = threading.Event()
    healthy.set()
    wd = Watchdog(Notifier.from_env(env), stop)
    wd.add_check("frame_loop", healthy.is_set)
    assert wd.start()
    try:
        assert notify_socket.recv() == "WATCHDOG=1"
        assert notify_socket.recv() == "WATCHDOG=1"

        healthy.clear()
        wait_until(lambda: wd.withheld >= 1)
        notify_socket.pending()  # a ping sent before the check failed
        withheld = wd.withheld
        wait_until(lambda: wd.withheld >= withheld + 3)
        assert notify_socket.pending() == [], "pinged while a liveness check failed"

        healthy.set()
        assert notify_socket.recv() == "WATCHDOG=1"
    finally:
        stop.set()
        assert wd.join(timeout=patient(10))


# --- the environment path in a real child process --------------------------------------------

CHILD = """
import threading
from agent.watchdog.systemd import Notifier, Watchdog
n = Notifier.from_env()
assert n.watchdog_interval_s() == 4.0, n.watchdog_interval_s()
assert n.extend_timeout(5)
assert n.ready("child up")
stop = threading.Event()
wd = Watchdog(n, stop)
wd.add_check("always", lambda: True)
assert wd.start()
while wd.pings < 1:
    stop.wait(0.01)
stop.set()
assert wd.join(10)
assert n.stopping()
"""


def test_child_process_notifies_through_the_environment(notify_socket: NotifySocket) -> None:
    env = {**os.environ, **notify_socket.env(WATCHDOG_USEC="4000000"), "PYTHONPATH": str(REPO)}
    # exec keeps the shell's pid, so WATCHDOG_PID=$$ names the Python process, as systemd would.
    cmd = ["/bin/sh", "-c", 'WATCHDOG_PID=$$ exec "$0" -c "$1"', sys.executable, CHILD]
    done = subprocess.run(
        cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=patient(60), check=False
    )
    assert done.returncode == 0, done.stderr
    received = [notify_socket.recv() for _ in range(4)]
    assert received == ["EXTEND_TIMEOUT_USEC=5000000", "READY=1\nSTATUS=child up", "WATCHDOG=1", "STOPPING=1"]


# --- the unit file ----------------------------------------------------------------------------


def read_unit() -> configparser.ConfigParser:
    return read_unit_file(UNIT)


def test_unit_has_the_required_settings() -> None:
    unit = read_unit()
    service = unit["Service"]
    expected = {
        "Type": "notify",
        "NotifyAccess": "main",
        "ExecStart": "/var/lib/edge-agent/releases/good/bin/python -I -m agent.lifecycle.release.launcher "
        "/var/lib/edge-agent/releases -- -m agent run -c /etc/edge-agent/agent.yaml",
        "ExecReload": "/bin/kill -HUP $MAINPID",
        "WatchdogSec": "30",
        "Restart": "on-failure",
        "RestartSec": "5",
        "TimeoutStopSec": "15",
        "StateDirectory": "edge-agent",
        "CacheDirectory": "edge-agent",
        "User": "edge-agent",
        "SupplementaryGroups": "video",
        "ProtectSystem": "strict",
        "ProtectHome": "true",
        "NoNewPrivileges": "true",
        "ProtectKernelTunables": "true",
        "ProtectControlGroups": "true",
        "RestrictSUIDSGID": "true",
        "LockPersonality": "true",
        "LimitMEMLOCK": "infinity",
        "Environment": "PYTHONUNBUFFERED=1",
    }
    assert {k: service.get(k) for k in expected} == expected
    assert set(service["ReadWritePaths"].split()) == {"/var/lib/edge-agent", "/var/cache/edge-agent"}
    # Any of these would cut the agent off the GPU, DLA and camera device nodes.
    for forbidden in ("PrivateDevices", "DevicePolicy", "DeviceAllow", "ProtectClock"):
        assert forbidden not in service, forbidden
    assert unit["Install"]["WantedBy"] == "multi-user.target"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    analyze_verify(UNIT, tmp_path)


def test_the_documentation_the_unit_names_is_what_the_install_steps_copy() -> None:
    """``Documentation=`` points into /opt/edge-agent/docs, which pip never installs: the documented
    install steps copy the repository's docs/ there, and the page it names is one of them."""
    [url] = read_unit()["Unit"]["Documentation"].split()
    page = url.removeprefix("file:///opt/edge-agent/docs/")
    assert page != url
    assert (REPO / "docs" / page).is_file()
    steps = (REPO / "docs" / "operations.md").read_text().split("## Install as a service")[1].split("```")[1]
    assert "cp -R /path/to/edge-agent/docs/. /opt/edge-agent/docs/" in steps
