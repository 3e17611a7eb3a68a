"""What changed between two configurations: the SIGHUP reload logs it, key by key.

Pure functions over the models (no I/O). Values are shown as the YAML would spell them, except
that a secret never is: a key named like a password, token or secret shows ``<redacted>``, and a
URL's password (``rtsp://user:pass@cam``) shows ``***``. Secret *files* (``password_file``,
``key_file``) are paths and are shown; their contents are never read here. A long value (a list
of a thousand labels) is summarised by its size, so one reload is one readable log line.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from agent.config.models import AgentConfig

#: Key names whose values are secrets (a ``..._file`` key holds a path to one, which may be shown).
SECRET_NAME = re.compile(r"password|passphrase|secret|token|api_key", re.IGNORECASE)
#: Values longer than this (as JSON) are replaced by a summary in the log.
_MAX_SHOWN = 160
#: Shown for a secret value.
REDACTED = "<redacted>"

#: What a SIGHUP applies without a restart, by key (``*`` is one slot name): the model of each
#: existing slot (hot-swapped), the watchdog's bound (read at every check) and, below, a running
#: stream's rate limit and framing.
_LIVE_SLOT_KEYS = frozenset(
    {
        "model",
        "model_id",
        "version",
        "backend",
        "providers",
        "intra_op_threads",
        "allow_spinning",
        "preprocess",
        "postprocess",
        "build",
    }
)
_LIVE_KEYS = frozenset({"watchdog.stuck_call_s"})
#: What a SIGHUP applies to a running stream (``streams.<name>.<key>[...]``), that stream alone.
LIVE_STREAM_KEYS = frozenset({"fps_limit", "rotate", "roi"})


@dataclass(frozen=True)
class ConfigChange:
    """One configuration key whose value differs; ``old``/``new`` are already safe to log."""

    key: str
    old: Any
    new: Any
    #: False: the key was absent from that side (a slot or stream added or removed).
    had_old: bool = True
    has_new: bool = True

    def shown(self) -> dict[str, Any]:
        """``{"old": ..., "new": ...}`` for a log line, leaving out the side where the key is absent."""
        out: dict[str, Any] = {}
        if self.had_old:
            out["old"] = self.old
        if self.has_new:
            out["new"] = self.new
        return out


def config_changes(old: AgentConfig, new: AgentConfig) -> list[ConfigChange]:
    """Every key (dotted path, lists as one value) whose value differs between ``old`` and ``new``."""
    before = _flatten(old.model_dump(mode="json"))
    after = _flatten(new.model_dump(mode="json"))
    changes = []
    for key in sorted(before.keys() | after.keys()):
        a, b = before.get(key, _ABSENT), after.get(key, _ABSENT)
        if a == b:
            continue
        changes.append(
            ConfigChange(
                key=key,
                old=None if a is _ABSENT else safe_value(key, a),
                new=None if b is _ABSENT else safe_value(key, b),
                had_old=a is not _ABSENT,
                has_new=b is not _ABSENT,
            )
        )
    return changes


def needs_restart(
    change: ConfigChange, running_slots: set[str], running_streams: set[str] | None = None
) -> bool:
    """True when a reload does not apply ``change`` (it waits for the next restart)."""
    if change.key in _LIVE_KEYS:
        return False
    parts = change.key.split(".")
    if len(parts) < 3:
        return True
    # <slots|streams>.<name>.<field>[...]: live for one that runs now; adding or removing one is not.
    if parts[0] == "slots":
        return not (parts[1] in running_slots and parts[2] in _LIVE_SLOT_KEYS)
    if parts[0] == "streams":
        return not (parts[1] in (running_streams or set()) and parts[2] in LIVE_STREAM_KEYS)
    return True


class _Absent:
    pass


_ABSENT = _Absent()


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict) and data:
        out: dict[str, Any] = {}
        for name, value in data.items():
            out.update(_flatten(value, f"{prefix}.{name}" if prefix else str(name)))
        return out
    return {prefix: data}


def safe_value(key: str, value: Any) -> Any:
    """``value`` of config key ``key`` as it may be logged: secrets hidden, long values summarised."""
    if SECRET_NAME.search(key.rsplit(".", 1)[-1]) and not key.endswith("_file"):
        return REDACTED if value is not None else None
    value = _hide_url_passwords(value)
    text = json.dumps(value)
    if len(text) <= _MAX_SHOWN:
        return value
    if isinstance(value, list):
        return f"<list of {len(value)} items>"
    if isinstance(value, dict):
        return f"<{len(value)} keys>"
    return f"<{len(text)} characters>"


def _hide_url_passwords(value: Any) -> Any:
    if isinstance(value, list):
        return [_hide_url_passwords(v) for v in value]
    if isinstance(value, dict):
        return {k: _hide_url_passwords(v) for k, v in value.items()}
    if isinstance(value, str) and "@" in value and "://" in value:
        try:
            parts = urlsplit(value)
        except ValueError:
            return value
        if parts.password is not None:
            host = parts.netloc.rsplit("@", 1)[1]
            return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))
    return value
