"""Which names and hashes a deploy manifest accepts: the field checks its models run.

Names end up in file names and MQTT topics, so a name with a path separator, ``..``, a control
character or a topic wildcard is refused with the pydantic error type ``bad_name`` (the device
answers code ``bad_name``, not ``bad_manifest``); a job id is also one topic level of plain
characters. Hashes are lowercase hex SHA-256, one per chunk, as many as the size needs.
"""

from __future__ import annotations

import math

from pydantic_core import PydanticCustomError

#: A lowercase hex SHA-256 (a pydantic ``pattern``).
SHA256_PATTERN = r"^[0-9a-f]{64}$"
_JOB_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
_MAX_NAME = 128


def bad_name(field: str, value: str, why: str) -> PydanticCustomError:
    """The error of a refused name: ``parse_signed`` tells it from a shape error by its type."""
    # A custom error type, so parse_signed can tell a dangerous name (code bad_name) from a shape error.
    # Its template knows only plain {name} placeholders (no !r): the value goes in already quoted.
    return PydanticCustomError(
        "bad_name", "{field} {value} {why}", {"field": field, "value": repr(value), "why": why}
    )


def check_path_safe(field: str, value: str) -> str:
    """Names end up in file names and topics: refuse separators, '..', NUL and control characters."""
    if not value:
        raise bad_name(field, value, "must not be empty")
    if len(value) > _MAX_NAME:
        raise bad_name(field, value[:32] + "...", f"is longer than {_MAX_NAME} characters")
    if "/" in value or "\\" in value:
        raise bad_name(field, value, "must not contain a path separator")
    if ".." in value:
        raise bad_name(field, value, "must not contain '..'")
    if any(ord(c) < 32 or c in "+#\x7f" for c in value):
        raise bad_name(field, value, "must not contain control characters, '+' or '#'")
    return value


def check_job_id(value: str) -> str:
    """A job id is one topic level and part of file names."""
    check_path_safe("job_id", value)
    if not set(value) <= _JOB_ID_CHARS:
        raise bad_name("job_id", value, "may only contain letters, digits, '_', '.' and '-'")
    return value


def check_chunk_hashes(value: list[str]) -> list[str]:
    """Every chunk hash is a lowercase hex SHA-256."""
    for i, digest in enumerate(value):
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(f"chunk {i}: {digest!r} is not a lowercase hex SHA-256")
    return value


def check_chunk_count(size: int, chunk_size: int, chunks: list[str]) -> None:
    """As many chunk hashes as ``size`` in chunks of ``chunk_size`` needs."""
    expected = math.ceil(size / chunk_size)
    if len(chunks) != expected:
        raise ValueError(
            f"chunks has {len(chunks)} hashes but size {size} / chunk_size {chunk_size} needs {expected}"
        )
