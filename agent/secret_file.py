"""Secrets kept in files (the MQTT password): read one, warn when others may read it too.

At the ground floor (docs/architecture.md): the MQTT clients read the password with it, and the
configuration, below the clients, names the files; neither may import the other's package.
"""

from __future__ import annotations

from pathlib import Path

import structlog

from agent.errors import ConfigError

_log = structlog.get_logger(__name__)


def read_secret(path: Path) -> str:
    """Return the secret stored in the file at ``path``, without its trailing newline.

    Logs ``config.secret.readable`` (a warning) when the file is readable by group or others.
    """
    path = Path(path)
    try:
        mode = path.stat().st_mode
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(
            f"cannot read secret file {path}: {reason}; check that it exists and the agent may read it"
        ) from exc
    if mode & 0o044:
        _log.warning(
            "config.secret.readable",
            path=str(path),
            mode=oct(mode & 0o777),
            hint=f"restrict it with: chmod 600 {path}",
        )
    if text.endswith("\r\n"):
        text = text[:-2]
    elif text.endswith("\n"):
        text = text[:-1]
    if not text:
        raise ConfigError(f"secret file {path} is empty; write the secret into it")
    return text
