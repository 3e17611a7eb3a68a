"""``fleet logs``: a device's latest log lines, and ``--follow``: its new lines as they come.

The device keeps its lines numbered (``seq``) in a bounded, redacted ring (``logs`` command,
docs/protocol.md). Following is polling with a cursor, the last ``seq`` printed: every line is
printed once, in order; lines that left the device's ring between two polls are reported as
missed (how many), never skipped silently; a restarted agent (a new ``boot``) numbers from 1
again, which is said too. Lines are device text: printed through :func:`agent.fleet.base.untrusted.shown`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, TextIO

from agent.errors import TransportError
from agent.fleet.base.untrusted import shown
from agent.fleet.devices.command import DeviceRefusedError, DeviceSession
from agent.mqtt.settings import MqttSettings
from agent.protocol.messages import CommandReply

#: Longest device line printed (the device cuts its own at 8,192 characters).
LINE_LIMIT = 8400
#: Lines asked for per poll while following (the device's cap).
FOLLOW_BATCH = 1000


@dataclass
class LogCursor:
    """Where a follower is in a device's log: its boot and the last line number printed."""

    boot: str | None = None
    after: int | None = None
    #: Notes for the operator (missed lines, a restart), in order, taken by the caller.
    notes: list[str] = field(default_factory=list)

    def take(self, reply: CommandReply) -> tuple[list[str], bool]:
        """The lines of ``reply`` to print, and whether more wait on the device; advances the cursor."""
        if not reply.ok:
            raise DeviceRefusedError(reply)
        try:
            return self._take(reply.result or {})
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise TransportError(f"the device's logs reply does not parse ({exc!r})") from exc

    def _take(self, result: dict[str, Any]) -> tuple[list[str], bool]:
        boot = str(result.get("boot", ""))
        if self.boot is not None and boot != self.boot:
            self.notes.append(
                f"-- the agent restarted (boot {shown(boot, 20)}): its numbering begins again --"
            )
            self.boot, self.after = boot, 0
            return [], True  # ask again from the new boot's first line
        self.boot = boot
        missed = int(result.get("missed", 0))
        if missed > 0:
            self.notes.append(
                f"-- {missed} line(s) missed: they left the device's log ring before this read --"
            )
        printed: list[str] = []
        for entry in result.get("lines", []):
            seq = int(entry["seq"])
            if self.after is not None and seq <= self.after:
                continue  # never twice, whatever the device sends
            self.after = seq
            printed.append(shown(entry.get("line", ""), LINE_LIMIT))
        if self.after is None:
            self.after = int(result.get("last_seq", 0))
        return printed, bool(result.get("more", False))


def print_logs(
    settings: MqttSettings,
    device: str,
    lines: int,
    out: TextIO,
    err: TextIO,
    *,
    follow: bool = False,
    stop: threading.Event | None = None,
    interval_s: float = 1.0,
    timeout: float = 10.0,
) -> int:
    """Print ``device``'s last ``lines`` lines; with ``follow``, then its new ones until ``stop`` is set."""
    stop = stop or threading.Event()
    cursor = LogCursor()
    with DeviceSession(settings, device, "logs", timeout=timeout) as session:
        args: dict[str, Any] = {"lines": lines}
        while True:
            printed, more = cursor.take(session.ask(args))
            for note in cursor.notes:
                print(note, file=err, flush=True)
            cursor.notes.clear()
            for line in printed:
                print(line, file=out)
            out.flush()
            if not follow:
                return 0
            if not more and stop.wait(interval_s):
                return 0
            if stop.is_set():
                return 0
            args = {"lines": FOLLOW_BATCH, "after": cursor.after}
