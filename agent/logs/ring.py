"""The agent's latest log lines in memory, secrets redacted, for the ``logs`` command.

:class:`LogRing` is a logging handler beside the one writing stdout: it keeps each rendered line,
numbered from 1 (``seq``), under two bounds at once (lines and bytes; the oldest go first). Lines
are redacted as they are kept, so a secret never sits in this memory: the value of any key named
like a password, token or secret (the names the config-change log hides), a URL's
``user:password@``, a ``Bearer`` credential and a PEM private key block. A follower reads with a
cursor (the last ``seq`` it saw): no line twice, and lines that fell out of the ring between two
reads are counted as ``missed``, never silently skipped.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from agent.config.changes import REDACTED, SECRET_NAME
from agent.logs.setup import RingHandler
from agent.protocol.command_args import LogsArgs

#: Longest line kept; a longer one (a traceback of a deep stack) is cut, saying so.
MAX_LINE_CHARS = 8192
#: Bytes of a ``logs`` reply left for the JSON around the lines.
_REPLY_SLACK = 1024
#: Per line in a reply besides the line's JSON string: ``{"seq": N, "line": }``.
_LINE_OVERHEAD = 32

_KEY = rf"[^\"\s=]*(?:{SECRET_NAME.pattern})[^\"\s=]*"
_REDACTIONS: tuple[tuple[re.Pattern[str], str], ...] = (
    # A PEM private key, on one line as JSON renders it (newlines escaped) or as text.
    (
        re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?-----END [A-Z ]*PRIVATE KEY-----", re.DOTALL),
        "<redacted private key>",
    ),
    # JSON: "db_password": "x" or "token": 123
    (
        re.compile(rf"(\"{_KEY}\"\s*:\s*)(\"(?:[^\"\\]|\\.)*\"|[^,}}\]\s]+)", re.IGNORECASE),
        rf'\1"{REDACTED}"',
    ),
    # key=value as the console renderer (and many messages) write it. A bare value stops at a quote
    # that is not escaped: inside a JSON string it must not eat the string's end.
    (
        re.compile(
            rf"(\b{_KEY}=)('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|(?:\\.|[^\s,\"\\])+)", re.IGNORECASE
        ),
        rf"\1{REDACTED}",
    ),
    (re.compile(r"(bearer\s+)[A-Za-z0-9._~+/=-]+", re.IGNORECASE), rf"\1{REDACTED}"),
    (re.compile(r"//[^/@\s\"']*:[^/@\s\"']*@"), "//***@"),
)


def redact(line: str) -> str:
    """``line`` with every secret the patterns above know replaced."""
    for pattern, replacement in _REDACTIONS:
        line = pattern.sub(replacement, line)
    return line


class LogRing(RingHandler):
    """The latest rendered log lines, at most ``max_lines`` and about ``max_bytes`` (thread-safe)."""

    def __init__(self, max_lines: int, max_bytes: int) -> None:
        super().__init__()
        self.max_lines = max_lines
        self.max_bytes = max_bytes
        #: Tells a follower that the numbering began again (the agent restarted).
        self.boot = uuid.uuid4().hex[:12]
        self._lines: deque[tuple[int, str]] = deque()
        self._bytes = 0
        self._seq = 0
        self._ring_lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = redact(self.format(record))
        except Exception:  # noqa: BLE001 (logging must never raise into the caller)
            self.handleError(record)
            return
        if len(line) > MAX_LINE_CHARS:
            line = line[:MAX_LINE_CHARS] + f"... [cut: {len(line)} characters]"
        size = len(line.encode("utf-8", "replace"))
        with self._ring_lock:
            self._seq += 1
            self._lines.append((self._seq, line))
            self._bytes += size
            # The newest line stays even alone over max_bytes (lines are cut at MAX_LINE_CHARS).
            while len(self._lines) > 1 and (
                len(self._lines) > self.max_lines or self._bytes > self.max_bytes
            ):
                _, old = self._lines.popleft()
                self._bytes -= len(old.encode("utf-8", "replace"))

    def read(self, lines: int, after: int | None = None, max_bytes: int | None = None) -> dict[str, Any]:
        """At most ``lines`` lines (and ``max_bytes``): the latest ones, or the first ones numbered
        above ``after``. ``missed``: lines above ``after`` that already left the ring; ``more``:
        lines above the last one returned are waiting; ``last_seq``: the newest line's number."""
        budget = max_bytes if max_bytes is not None else self.max_bytes
        with self._ring_lock:
            kept = list(self._lines)
            last_seq = self._seq
        picked: list[tuple[int, str]] = []
        used = 0
        missed = 0
        if after is None:
            for seq, line in reversed(kept):
                used += len(json.dumps(line)) + _LINE_OVERHEAD
                if len(picked) >= lines or (used > budget and picked):
                    break
                picked.append((seq, line))
            picked.reverse()
            more = False
        else:
            newer = [(seq, line) for seq, line in kept if seq > after]
            if after < last_seq:
                first = newer[0][0] if newer else last_seq + 1
                missed = max(0, first - after - 1)
            for seq, line in newer:
                used += len(json.dumps(line)) + _LINE_OVERHEAD
                if len(picked) >= lines or (used > budget and picked):
                    break
                picked.append((seq, line))
            more = len(picked) < len(newer)
        return {
            "boot": self.boot,
            "lines": [{"seq": seq, "line": line} for seq, line in picked],
            "last_seq": last_seq,
            "missed": missed,
            "more": more,
        }


def logs_command(ring: LogRing, payload_limit: Callable[[], int]) -> Callable[[LogsArgs], dict[str, Any]]:
    """The ``logs`` handler: ``ring``'s lines, as many as ``args.lines`` and the MQTT reply allow."""

    def serve(args: LogsArgs) -> dict[str, Any]:
        budget = max(_REPLY_SLACK, payload_limit() - _REPLY_SLACK)
        return ring.read(args.lines, args.after, max_bytes=budget)

    return serve
