"""sd_notify from the real daemon, received on a real AF_UNIX datagram socket set as NOTIFY_SOCKET.

This is systemd's side of ``Type=notify`` with ``WatchdogSec=2``: the socket checks the sender's
credentials (SO_PASSCRED), as systemd does with ``NotifyAccess=main``.
"""

from __future__ import annotations

import itertools
import signal
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agent.demo.broker import Broker
from tests.camera.mjpeg_server import MjpegServer
from tests.e2e.daemon import AgentFiles, Daemon
from tests.waiting import patient, wait_until

pytestmark = pytest.mark.slow

WATCHDOG_USEC = 2_000_000
WATCHDOG_S = WATCHDOG_USEC / 1_000_000


@dataclass(frozen=True)
class Notification:
    """One datagram: its ``KEY=value`` fields, the pid the kernel says sent it, when it came (monotonic)."""

    fields: dict[str, str]
    pid: int
    at: float = field(default_factory=time.monotonic)


class NotifySocket:
    """A bound SOCK_DGRAM socket collecting notifications on a thread, like systemd's notify socket."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.received: list[Notification] = []
        self._cond = threading.Condition()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._sock.bind(str(path))
        self._sock.settimeout(0.1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="notify-socket", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ucred = struct.calcsize("3i")
        while not self._stop.is_set():
            try:
                data, ancillary, _flags, _addr = self._sock.recvmsg(4096, socket.CMSG_SPACE(ucred))
            except TimeoutError:
                continue
            except OSError:
                return
            pid = 0
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = struct.unpack("3i", payload[:ucred])[0]
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            with self._cond:
                self.received.append(Notification(fields, pid))
                self._cond.notify_all()

    def wait_for(
        self, what: str, predicate: Callable[[list[Notification]], bool], timeout: float = 30.0
    ) -> None:
        """Until ``predicate`` holds, at most ``timeout`` seconds times the suite's patience: a daemon
        imports numpy, OpenCV and ONNX before READY=1, which a loaded machine takes many times longer for."""
        bound = patient(timeout)
        with self._cond:
            if not self._cond.wait_for(lambda: predicate(self.received), bound):
                raise AssertionError(f"no {what} within {bound}s; got {[n.fields for n in self.received]}")

    def count(self, key: str) -> int:
        with self._cond:
            return sum(key in n.fields for n in self.received)

    def snapshot(self) -> list[Notification]:
        with self._cond:
            return list(self.received)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(patient(5))
        self._sock.close()


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[NotifySocket]:
    path = tmp_path / "notify.sock"
    if len(str(path)) >= 100:  # sun_path holds 108 bytes
        path = Path(f"/tmp/notify-{uuid.uuid4().hex[:8]}.sock")
    sock = NotifySocket(path)
    yield sock
    sock.close()
    path.unlink(missing_ok=True)


def _index(notes: list[Notification], key: str, value: str | None = None, after: int = -1) -> int:
    for i, note in enumerate(notes):
        if i > after and key in note.fields and (value is None or note.fields[key] == value):
            return i
    raise AssertionError(f"no {key}={value or '*'} after #{after} in {[n.fields for n in notes]}")


def _ready_after_reload(notes: list[Notification]) -> bool:
    reloads = [i for i, n in enumerate(notes) if "RELOADING" in n.fields]
    return bool(reloads) and any("READY" in n.fields for n in notes[reloads[0] + 1 :])


def test_ready_watchdog_reload_stopping(
    tmp_path: Path, broker: Broker, notify_socket: NotifySocket, monkeypatch: pytest.MonkeyPatch
) -> None:
    # WATCHDOG_PID must be unset or name the daemon itself; an inherited one would switch it off.
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    files = AgentFiles(tmp_path, broker.port, f"sd-{uuid.uuid4().hex[:8]}", frames=30)
    stream = {"source": {"type": "file", "path": str(files.video), "loop": True, "realtime": True}}
    config = files.write_config(stream=stream)
    env = {"NOTIFY_SOCKET": str(notify_socket.path), "WATCHDOG_USEC": str(WATCHDOG_USEC)}
    daemon = Daemon(config, tmp_path / "agent.log", env=env)
    try:
        notify_socket.wait_for("READY=1", lambda ns: any("READY" in n.fields for n in ns))
        ready_at = len(notify_socket.snapshot())
        # The watchdog pings every WatchdogSec/2 while the frame loop and the MQTT link are alive.
        notify_socket.wait_for(
            "two watchdog pings", lambda ns: sum("WATCHDOG" in n.fields for n in ns[ready_at - 1 :]) >= 2
        )
        files.write_config(model=files.v2, version="2", stream=stream)
        daemon.signal(signal.SIGHUP)
        notify_socket.wait_for("READY=1 after RELOADING=1", _ready_after_reload)
    finally:
        code = daemon.stop()
    assert code == 0, daemon.log()[-3000:]
    notify_socket.wait_for("STOPPING=1", lambda ns: any("STOPPING" in n.fields for n in ns), timeout=5)
    notes = notify_socket.snapshot()

    assert all(n.pid == daemon.proc.pid for n in notes), "a notification came from another process"
    ready = _index(notes, "READY", "1")
    assert notes[ready].fields["STATUS"].startswith("serving cls=cls:1")
    assert _index(notes, "EXTEND_TIMEOUT_USEC") < ready  # the first model load may take long
    watchdogs = [i for i, n in enumerate(notes) if n.fields.get("WATCHDOG") == "1"]
    assert len(watchdogs) >= 2
    reloading = _index(notes, "RELOADING", "1")
    assert int(notes[reloading].fields["MONOTONIC_USEC"]) > 0
    assert reloading > ready
    ready_again = _index(notes, "READY", "1", after=reloading)
    assert "STATUS" in notes[ready_again].fields
    stopping = _index(notes, "STOPPING", "1")
    assert stopping > ready_again
    assert all("READY" not in n.fields for n in notes[stopping:])


def _pings(notes: list[Notification]) -> list[float]:
    return [n.at for n in notes if n.fields.get("WATCHDOG") == "1"]


def _events(daemon: Daemon, event: str, **match: Any) -> list[dict[str, Any]]:
    return [
        e for e in daemon.events() if e.get("event") == event and all(e.get(k) == v for k, v in match.items())
    ]


def test_watchdog_is_withheld_while_a_camera_read_hangs_and_kept_while_an_unplugged_camera_reconnects(
    tmp_path: Path, broker: Broker, notify_socket: NotifySocket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """systemd restarts a daemon whose capture is stuck inside a driver call, not one whose camera is gone.

    The camera is a real HTTP MJPEG server that stops in the middle of a frame with the connection
    open: FFmpeg blocks in its read (up to its own 5 s timeout, longer than ``stuck_call_s``).
    """
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    camera = MjpegServer().start()
    files = AgentFiles(tmp_path, broker.port, f"sd-{uuid.uuid4().hex[:8]}", frames=10)
    source = {"type": "url", "url": camera.url, "reconnect_min_s": 0.2, "reconnect_max_s": 0.5}
    config = files.write_config(
        stream={"source": source, "drop_policy": "keep_newest", "results_qos": 0},
        watchdog={"stuck_call_s": 1.0},
    )
    env = {"NOTIFY_SOCKET": str(notify_socket.path), "WATCHDOG_USEC": str(WATCHDOG_USEC)}
    daemon = Daemon(config, tmp_path / "agent.log", env=env)
    try:
        notify_socket.wait_for("READY=1", lambda ns: any("READY" in n.fields for n in ns))
        notify_socket.wait_for("two watchdog pings while streaming", lambda ns: len(_pings(ns)) >= 2)
        assert _events(daemon, "camera.source.state", new="streaming")

        camera.stall()
        stuck = daemon.wait_for_event("pipeline.stuck", timeout=10.0)
        assert any(
            p.startswith("stream cam: camera driver read() has not returned") for p in stuck["problems"]
        )
        # No ping for longer than WatchdogSec: systemd would now kill and restart the service.
        wait_until(
            lambda: time.monotonic() - _pings(notify_socket.snapshot())[-1] > WATCHDOG_S + 0.5,
            timeout=4.0,
            what=f"a silence of more than WatchdogSec={WATCHDOG_S:g} s",
        )
        withheld = _events(daemon, "systemd.watchdog.withheld")
        assert withheld
        assert all(e["failing"] == ["frame_loop"] for e in withheld)

        camera.stop()  # unplugged: the read fails at once, every reopen is refused, backoff in between
        wait_until(
            lambda: len(_events(daemon, "camera.source.failed", phase="open")) >= 1,
            timeout=10.0,
            what="the first refused reopen",
        )
        first_retry, retry_seen = len(daemon.events()), time.monotonic()
        pings_before = len(_pings(notify_socket.snapshot()))
        wait_until(
            lambda: (
                len(_events(daemon, "camera.source.failed", phase="open")) >= 4
                and len(_pings(notify_socket.snapshot())) >= pings_before + 3
            ),
            timeout=20.0,
            what="three more refused reopens and three pings",
        )
        later = daemon.events()[first_retry:]
        assert not [e for e in later if e.get("event") in ("pipeline.stuck", "systemd.watchdog.withheld")]
        reconnecting = [retry_seen, *_pings(notify_socket.snapshot())[pings_before:]]
        gaps = [b - a for a, b in itertools.pairwise(reconnecting)]
        assert max(gaps) < WATCHDOG_S, gaps  # pinged all along: systemd leaves it running
        assert daemon.proc.poll() is None
    finally:
        camera.stop()
        code = daemon.stop()
    assert code == 0, daemon.log()[-3000:]
