"""A delivered configuration overlay read and checked: YAML, the keys an overlay may set, sealed values.

Top-level keys must be among :data:`~agent.protocol.device_targets.OVERLAY_KEYS`; the dotted keys in
:data:`~agent.protocol.device_targets.OVERLAY_DENIED_KEYS` may not be set. A sealed value
(:mod:`agent.protocol.sealed`) is accepted only under a key in :data:`SEALABLE_KEYS`: the device
opens it with its enrollment key, writes the clear value to a 0600 file and the overlay names that
file under the matching ``*_file`` key (the secret never stands in the overlay or the log).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from agent.enrollment.keys import load_key
from agent.errors import ConfigError
from agent.protocol.delivery_errors import ConfigInvalidError
from agent.protocol.device_targets import MAX_OVERLAY_BYTES, OVERLAY_DENIED_KEYS, OVERLAY_KEYS
from agent.protocol.sealed import SealedValueError, is_sealed, open_sealed

#: Keys whose value may be sealed, and the ``*_file`` key the opened value's file is named under:
#: a network camera's password (the URL names the user, the file holds the password).
SEALABLE_KEYS = {"streams.*.source.password": "password_file"}

#: Opens one sealed value for a dotted key path (the device's enrollment key, its id).
OpenFn = Callable[[str, str], bytes]


@dataclass(frozen=True)
class Overlay:
    """A checked overlay: its data with sealed values still sealed, and where each sealed value sits."""

    data: dict[str, Any]
    sealed: tuple[str, ...]


def read_overlay(document: Path, job_id: str) -> Overlay:
    """The overlay in ``document``; :class:`ConfigInvalidError` naming the key that is wrong."""
    raw = document.read_bytes()
    if len(raw) > MAX_OVERLAY_BYTES:
        raise ConfigInvalidError(
            f"the overlay has {len(raw)} bytes, more than {MAX_OVERLAY_BYTES}", job_id=job_id
        )
    try:
        data = yaml.safe_load(raw.decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigInvalidError(f"the overlay is not YAML text: {exc}", job_id=job_id) from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigInvalidError("the overlay must be a mapping of agent.yaml keys", job_id=job_id)
    for key in data:
        if key not in OVERLAY_KEYS:
            raise ConfigInvalidError(
                f"{key}: an overlay may not set this key (it may set: {', '.join(sorted(OVERLAY_KEYS))})",
                job_id=job_id,
            )
    sealed = []
    for path, value in _leaves(data):
        for denied in OVERLAY_DENIED_KEYS:
            if path == denied or path.startswith(denied + "."):
                raise ConfigInvalidError(
                    f"{denied}: an overlay may not set this key (trust changes only through the fleet root)",
                    job_id=job_id,
                )
        if is_sealed(value):
            if sealable(path) is None:
                raise ConfigInvalidError(
                    f"{path}: a sealed value is accepted only under {', '.join(SEALABLE_KEYS)}",
                    job_id=job_id,
                )
            sealed.append(path)
    return Overlay(data, tuple(sealed))


def sealable(path: str) -> str | None:
    """The ``*_file`` key a sealed value at ``path`` is written to; None when it may not be sealed."""
    for pattern, file_key in SEALABLE_KEYS.items():
        if fnmatch.fnmatchcase(path, pattern) and path.count(".") == pattern.count("."):
            return file_key
    return None


def opened(overlay: Overlay, open_value: OpenFn, job_id: str) -> dict[str, bytes]:
    """Every sealed value of ``overlay`` opened, by key path; ConfigInvalidError for one that does not."""
    values = {}
    for path in overlay.sealed:
        text = _get(overlay.data, path)
        try:
            values[path] = open_value(text, path)
        except SealedValueError as exc:
            raise ConfigInvalidError(str(exc), job_id=job_id) from exc
    return values


def with_secret_files(overlay: Overlay, files: dict[str, Path]) -> dict[str, Any]:
    """The overlay's data with each sealed value replaced by its ``*_file`` key naming ``files[path]``."""
    data: dict[str, Any] = yaml.safe_load(yaml.safe_dump(overlay.data))  # a deep copy of plain data
    for path in overlay.sealed:
        parent_path, _, name = path.rpartition(".")
        parent = _get(data, parent_path)
        del parent[name]
        file_key = sealable(path)
        assert file_key is not None  # checked by read_overlay
        parent[file_key] = str(files[path])
    return data


def opener(key_file: Path | None, device_id: str) -> OpenFn:
    """Opens values sealed to this device's enrollment key (``mqtt.tls.key_file``)."""

    def open_value(text: str, path: str) -> bytes:
        if key_file is None:
            raise SealedValueError(f"{path}: this device has no enrollment key (mqtt.tls.key_file)")
        try:
            key = load_key(key_file)
        except ConfigError as exc:
            raise SealedValueError(f"{path}: {exc}") from exc
        return open_sealed(text, key, device_id, path)

    return open_value


def _leaves(data: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(data, dict):
        for name, value in data.items():
            path = f"{prefix}.{name}" if prefix else str(name)
            yield path, value
            yield from _leaves(value, path)


def _get(data: dict[str, Any], path: str) -> Any:
    node: Any = data
    for part in path.split("."):
        node = node[part]
    return node
