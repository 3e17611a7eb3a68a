"""What the INT8 accuracy guard found for each engine checked on this device, so that it is not
checked again: a rollback or a restart that comes back to an INT8 engine (or to the FP16 engine that
replaced a rejected one) takes the known verdict instead of running both models over held-out
frames once more (seconds to minutes on a Jetson, past a command's reply timeout).

Kept beside the engine cache (``engines/int8_guard.json``), small and bounded: at most
:data:`MAX_ENGINES` engines, the least recently checked go first. A verdict holds for one engine
file: the cache key with the file's size and modification time (a rebuild under the same key is
checked afresh). The figures are kept, not only the verdict: a changed ``engines.int8_agreement``
judges them again. A file that cannot be read is started afresh (the guard then runs, as before).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import structlog

from agent.engines.guard.agreement import GuardReport, check_int8
from agent.fsutil import atomic_write_json

log = structlog.get_logger(__name__)

MAX_ENGINES = 256
MEMO_FILE = "int8_guard.json"

#: A verdict: whether the engine may go live, the one-line reason, the agreement figures (or None).
Verdict = tuple[bool, str, dict[str, Any] | None]


class GuardMemo:
    """The INT8 guard's verdicts by engine file, in ``directory/int8_guard.json``."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / MEMO_FILE
        self._lock = threading.Lock()

    def known(self, key: str, engine: Path, threshold: float) -> Verdict | None:
        """The verdict for ``engine`` (cache ``key``) if it was checked before, judged at ``threshold``."""
        identity = _identity(engine)
        if identity is None:
            return None
        with self._lock:
            entry = self._read().get(key)
        if not isinstance(entry, dict) or entry.get("engine") != identity:
            return None
        report = entry.get("report")
        if isinstance(report, dict):
            try:
                ok, reason = check_int8(GuardReport(**report), threshold)
            except TypeError:
                return None  # figures of another layout: check again
            return ok, reason, report
        return bool(entry.get("passed")), str(entry.get("reason", "")), None

    def remember(self, key: str, engine: Path, verdict: Verdict) -> None:
        """Keep ``verdict`` for ``engine``; a disk that refuses it is logged (the guard runs next time)."""
        identity = _identity(engine)
        if identity is None:
            return
        ok, reason, report = verdict
        with self._lock:
            memo = self._read()
            memo.pop(key, None)
            memo[key] = {
                "engine": identity,
                "passed": ok,
                "reason": reason,
                "report": report,
                "at": time.time(),
            }
            while len(memo) > MAX_ENGINES:
                memo.pop(next(iter(memo)))
            try:
                atomic_write_json(self.path, memo)
            except OSError as exc:
                log.warning("engine.int8_guard.not_remembered", key=key, error=str(exc))

    def _read(self) -> dict[str, Any]:
        try:
            memo = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            log.warning("engine.int8_guard.unreadable", path=str(self.path), error=str(exc))
            return {}
        return memo if isinstance(memo, dict) else {}


def _identity(engine: Path) -> list[int] | None:
    """The engine file's size and modification time (ns); None when it cannot be read."""
    try:
        stat = engine.stat()
    except OSError:
        return None
    return [stat.st_size, stat.st_mtime_ns]
