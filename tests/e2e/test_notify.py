"""sd_notify from the real daemon, received on a real AF_UNIX datagram socket set as NOTIFY_SOCKET.

This is systemd's side of ``Type=notify`` with ``WatchdogSec=2``: the socket checks the sender's
credentials (SO_PASSCRED), as systemd does with ``NotifyAccess=main``.
"""

from __future__ import annotations

import signal
import socket
import struct
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.broker import Broker
from tests.e2e.daemon import AgentFiles, Daemon

pytestmark = pytest.mark.slow

WATCHDOG_USEC = 2_000_000


@dataclass(frozen=True)
class Notification:
    """One datagram: its ``KEY=value`` fields and the pid the kernel says sent it."""

    fields: dict[str, str]
    pid: int


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
        with self._cond:
            if not self._cond.wait_for(lambda: predicate(self.received), timeout):
                raise AssertionError(f"no {what} within {timeout}s; got {[n.fields for n in self.received]}")

    def count(self, key: str) -> int:
        with self._cond:
            return sum(key in n.fields for n in self.received)

    def snapshot(self) -> list[Notification]:
        with self._cond:
            return list(self.received)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
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
