"""systemd service notifications (sd_notify) and a liveness-gated watchdog, stdlib only.

The protocol is one datagram of ``KEY=value`` lines sent to the AF_UNIX socket named by
``$NOTIFY_SOCKET`` (a filesystem path, or ``@name`` for the abstract namespace). Without that
variable (run from a shell, in tests, in a container) every call is a no-op returning False, so
callers never need to ask whether they run under systemd.

See sd_notify(3) and systemd.service(5) (``Type=notify``, ``WatchdogSec=``).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Mapping

import structlog

log = structlog.get_logger(__name__)

LivenessCheck = Callable[[], bool]


def _socket_address(value: str) -> str | bytes | None:
    if value.startswith("@"):
        # Abstract namespace: a leading NUL byte instead of '@' (sd_notify does the same).
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    # vsock:... and other schemes (systemd >= 254) are for VMs; not an edge device's concern.
    return None


def _one_line(text: str) -> str:
    # A newline would start a new KEY=value assignment inside the datagram.
    return " ".join(text.splitlines())


class Notifier:
    """Sends state notifications to systemd; every method returns True if the datagram was sent."""

    def __init__(
        self,
        address: str | bytes | None,
        watchdog_usec: int | None = None,
        watchdog_pid: int | None = None,
    ) -> None:
        self.address = address
        self._watchdog_usec = watchdog_usec
        self._watchdog_pid = watchdog_pid
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, unset_environment: bool = False) -> Notifier:
        """A notifier for ``$NOTIFY_SOCKET`` / ``$WATCHDOG_USEC`` / ``$WATCHDOG_PID`` of ``env`` (os.environ).

        ``unset_environment`` removes those variables from ``os.environ`` afterwards, so child
        processes (engine build workers) do not inherit them; with ``NotifyAccess=main`` systemd
        ignores their messages anyway.
        """
        source = os.environ if env is None else env
        raw = source.get("NOTIFY_SOCKET", "")
        address = _socket_address(raw) if raw else None
        if raw and address is None:
            log.warning("systemd.notify.unsupported_socket", notify_socket=raw)
        watchdog_usec = _positive_int(source.get("WATCHDOG_USEC"))
        watchdog_pid = _positive_int(source.get("WATCHDOG_PID"))
        if unset_environment:
            for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
                os.environ.pop(key, None)
        return cls(address, watchdog_usec, watchdog_pid)

    @property
    def enabled(self) -> bool:
        """True when there is a socket to notify."""
        return self.address is not None

    def notify(self, *fields: str) -> bool:
        """Send ``KEY=value`` fields as one datagram; False if disabled or the send failed (logged)."""
        if self.address is None:
            return False
        payload = "\n".join(fields).encode()
        try:
            with self._lock:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.sendto(payload, self.address)
        except OSError as exc:
            log.warning("systemd.notify.failed", fields=[f.split("=", 1)[0] for f in fields], error=repr(exc))
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """Startup (or a reload) finished: ``READY=1``, optionally with a status line."""
        fields = ["READY=1"]
        if status is not None:
            fields.append(f"STATUS={_one_line(status)}")
        return self.notify(*fields)

    def status(self, text: str) -> bool:
        """Free-form status shown by ``systemctl status`` (``STATUS=...``)."""
        return self.notify(f"STATUS={_one_line(text)}")

    def watchdog(self) -> bool:
        """Keep-alive ping (``WATCHDOG=1``); prefer :class:`Watchdog`, which gates it on liveness."""
        return self.notify("WATCHDOG=1")

    def stopping(self) -> bool:
        """Shutdown began (``STOPPING=1``)."""
        return self.notify("STOPPING=1")

    def reloading(self) -> bool:
        """Reload began: ``RELOADING=1`` with ``MONOTONIC_USEC``; send :meth:`ready` when it is done.

        systemd >= 253 requires MONOTONIC_USEC for ``Type=notify-reload``; older ones ignore it.
        """
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={usec}")

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for ``seconds`` more before start/stop times out (a long engine build at startup)."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={max(0, round(seconds * 1_000_000))}")

    def watchdog_interval_s(self) -> float | None:
        """systemd's watchdog timeout in seconds, or None when the watchdog is off for this process."""
        if self._watchdog_usec is None:
            return None
        if self._watchdog_pid is not None and self._watchdog_pid != os.getpid():
            return None  # the variables were inherited from a parent: the watchdog is not ours
        return self._watchdog_usec / 1_000_000

    def close(self) -> None:
        """Close the socket (a later notify reopens it)."""
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


def _positive_int(value: str | None) -> int | None:
    if not value:
        return None
    try:
        n = int(value)
    except ValueError:
        return None
    return n if n > 0 else None


class Heartbeat:
    """A timestamp a working loop refreshes (``beat()`` per frame); a liveness check reads its age."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last = time.monotonic()

    def beat(self) -> None:
        """Record that the loop made progress (one float store: cheap enough per frame)."""
        self._last = time.monotonic()

    def age_s(self) -> float:
        """Seconds since the last beat."""
        return time.monotonic() - self._last

    def fresher_than(self, max_age_s: float) -> LivenessCheck:
        """A liveness check: True while the last beat is at most ``max_age_s`` old."""
        return lambda: self.age_s() <= max_age_s


class Watchdog:
    """Pings ``WATCHDOG=1`` every half timeout, but only while every liveness check passes.

    A check is a callable returning bool (frame loop heartbeat fresh, MQTT link healthy). When one
    fails (or raises) the ping is withheld and ``systemd.watchdog.withheld`` names it; if it stays
    failing for ``WatchdogSec``, systemd kills and restarts the service. That is the point: a
    thread that is alive but stuck must not keep the service looking healthy.
    """

    def __init__(self, notifier: Notifier, stop: threading.Event, interval_s: float | None = None) -> None:
        """``interval_s`` is the watchdog timeout (default: from the notifier's ``WATCHDOG_USEC``)."""
        self.notifier = notifier
        self.stop = stop
        self.timeout_s = interval_s if interval_s is not None else notifier.watchdog_interval_s()
        self.pings = 0
        self.withheld = 0
        self._checks: list[tuple[str, LivenessCheck]] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add_check(self, name: str, check: LivenessCheck) -> None:
        """Register a liveness check under a name that the withheld log line reports."""
        with self._lock:
            self._checks.append((name, check))

    def failing_checks(self) -> list[str]:
        """Names of the checks that fail now (a raising check counts as failing)."""
        with self._lock:
            checks = list(self._checks)
        failing = []
        for name, check in checks:
            try:
                ok = bool(check())
            except Exception as exc:  # noqa: BLE001 - a broken check means 'not alive', never a crash
                log.warning("systemd.watchdog.check_raised", check=name, error=repr(exc))
                ok = False
            if not ok:
                failing.append(name)
        return failing

    def tick(self) -> bool:
        """Run the checks once; ping if all pass. True if a ping was sent."""
        failing = self.failing_checks()
        if failing:
            self.withheld += 1
            log.warning("systemd.watchdog.withheld", failing=failing, timeout_s=self.timeout_s)
            return False
        sent = self.notifier.watchdog()
        if sent:
            self.pings += 1
        return sent

    def start(self) -> bool:
        """Start pinging; False (nothing started) when systemd's watchdog is off for this process."""
        if self.timeout_s is None or not self.notifier.enabled:
            log.info("systemd.watchdog.disabled")
            return False
        if self._thread is not None:
            raise RuntimeError("Watchdog.start() called twice")
        self._thread = threading.Thread(target=self._run, name="systemd-watchdog", daemon=False)
        self._thread.start()
        return True

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end after ``stop`` is set; True if it has ended (or never ran)."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        assert self.timeout_s is not None
        # Half the timeout, as sd_watchdog_enabled(3) recommends, so one late ping is not fatal.
        period = self.timeout_s / 2
        log.info("systemd.watchdog.started", timeout_s=self.timeout_s, checks=[n for n, _ in self._checks])
        self.tick()
        while not self.stop.wait(period):
            self.tick()
