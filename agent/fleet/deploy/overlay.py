"""A configuration overlay on the operator side: read and checked, its secrets sealed, compared.

An overlay is YAML over the device's own agent.yaml, limited to
:data:`~agent.protocol.device_targets.OVERLAY_KEYS` and never any of
:data:`~agent.protocol.device_targets.OVERLAY_DENIED_KEYS`: refused here, before it is signed,
as the device would refuse it (``config_invalid``). A secret never goes in as written: ``fleet
config set --secret KEY=@FILE`` seals the file's bytes to the device's key
(:mod:`agent.protocol.sealed`) and only the sealed string is kept or sent. What changes between
two overlays is shown key by key with the reload's redaction rules (:mod:`agent.config.changes`),
and a sealed value only as ``<sealed>``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml
from cryptography.hazmat.primitives.asymmetric import ec

from agent.config.changes import SECRET_NAME, ConfigChange, safe_value
from agent.errors import ConfigError
from agent.protocol.device_targets import MAX_OVERLAY_BYTES, OVERLAY_DENIED_KEYS, OVERLAY_KEYS
from agent.protocol.sealed import SEALED_PREFIX, is_sealed, seal

#: How a sealed value is shown: never its ciphertext (it changes at every seal and says nothing).
SEALED_SHOWN = "<sealed>"


def parse_overlay(text: bytes, name: str) -> dict[str, Any]:
    """The overlay in ``text`` (read from ``name``), checked (ConfigError listing every problem)."""
    if len(text) > MAX_OVERLAY_BYTES:
        raise ConfigError(f"{name}: {len(text)} bytes, more than the {MAX_OVERLAY_BYTES} an overlay may be")
    try:
        data = yaml.safe_load(text.decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{name}: not YAML text ({exc})") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{name}: an overlay is a mapping of agent.yaml keys, not {type(data).__name__}")
    problems = overlay_problems(data)
    if problems:
        raise ConfigError(f"{name}: the overlay sets keys a device does not take from the fleet", problems)
    return data


def read_overlay(path: Path) -> dict[str, Any]:
    """The overlay file at ``path``, checked (ConfigError naming the file and every problem)."""
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    return parse_overlay(text, str(path))


def overlay_problems(data: Mapping[str, Any]) -> list[str]:
    """Every key of ``data`` an overlay may not set, each with why (empty: none)."""
    problems = [
        f"{key}: not a key an overlay sets (it may set: {', '.join(sorted(OVERLAY_KEYS))})"
        for key in data
        if key not in OVERLAY_KEYS
    ]
    dotted = flatten(data)
    problems.extend(
        f"{denied}: decides whom the device trusts; it changes only through the fleet root"
        for denied in sorted(OVERLAY_DENIED_KEYS)
        if any(key == denied or key.startswith(denied + ".") for key in dotted)
    )
    problems.extend(_clear_secrets(dotted))
    return problems


def _clear_secrets(dotted: Mapping[str, Any]) -> list[str]:
    """A secret written in clear: the operator side would keep it and send it as written."""
    problems = []
    for key, value in sorted(dotted.items()):
        if not isinstance(value, str) or not value or is_sealed(value):
            continue
        name = key.rsplit(".", 1)[-1]
        if SECRET_NAME.search(name) and not name.endswith("_file"):
            problems.append(
                f"{key}: a secret in clear; seal it to the device: `fleet config set --secret {key}=@FILE`"
            )
        elif "://" in value and "@" in value and _url_password(value):
            parent = key.rsplit(".", 1)[0]
            problems.append(
                f"{key}: a password in the URL; leave it out and seal it as {parent}.password "
                f"(`fleet config set --secret {parent}.password=@FILE`)"
            )
    return problems


def _url_password(value: str) -> bool:
    try:
        return urlsplit(value).password is not None
    except ValueError:
        return False


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """``data``'s leaves by dotted key (a list is one leaf, as the reload's changes count it)."""
    if isinstance(data, Mapping) and data:
        out: dict[str, Any] = {}
        for name, value in data.items():
            out.update(flatten(value, f"{prefix}.{name}" if prefix else str(name)))
        return out
    return {prefix: data} if prefix else {}


def with_sealed(
    data: Mapping[str, Any], key: str, value: bytes, public_key: ec.EllipticCurvePublicKey, device_id: str
) -> dict[str, Any]:
    """``data`` with dotted ``key`` set to ``value`` sealed to ``device_id``'s key (ConfigError when
    an overlay may not set that key)."""
    parts = key.split(".")
    if not all(parts):
        raise ConfigError(f"--secret {key}: not a dotted key (streams.door.password)")
    problems = overlay_problems({parts[0]: _nested(parts[1:], SEALED_PREFIX)})
    if problems:
        raise ConfigError(f"--secret {key}: an overlay may not set it", problems)
    try:
        sealed = seal(value, public_key, device_id, key)
    except ValueError as exc:
        raise ConfigError(f"--secret {key}: {exc}") from exc
    out = _copy(data)
    node = out
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = sealed
    return out


def dump_overlay(data: Mapping[str, Any]) -> bytes:
    """The overlay as the YAML bytes a device gets (keys in the order written)."""
    return yaml.safe_dump(dict(data), sort_keys=False, allow_unicode=True).encode("utf-8")


def overlay_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[ConfigChange]:
    """What ``new`` changes against ``old``, key by key, secrets never shown."""
    before, after = flatten(old), flatten(new)
    changes = []
    for key in sorted(before.keys() | after.keys()):
        had, has = key in before, key in after
        a, b = before.get(key), after.get(key)
        if had and has and a == b:
            continue
        changes.append(
            ConfigChange(key=key, old=_shown(key, a), new=_shown(key, b), had_old=had, has_new=has)
        )
    return changes


def _shown(key: str, value: Any) -> Any:
    return SEALED_SHOWN if is_sealed(value) else safe_value(key, value)


def _nested(parts: list[str], leaf: Any) -> Any:
    for part in reversed(parts):
        leaf = {part: leaf}
    return leaf


def _copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}
