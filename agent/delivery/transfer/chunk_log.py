"""The ``<sha>.log`` of a partial download: chunks made durable since the bitmap was last written.

The bitmap (:mod:`agent.delivery.transfer.bitmap`) is the snapshot, replaced atomically (temporary
file, fsync, rename, directory fsync); this log is what each flush adds, appended and fdatasynced
once. A record is 8 bytes: the chunk index and a CRC-32 over a key derived from the manifest plus
that index. Reading stops at the first record that is short or fails its check, so a write torn by
a crash or power loss drops the records it touched (their chunks are fetched again) and cannot name
a chunk of its own: a garbled record would have to carry a matching CRC-32 by chance, and every
chunk the log names is re-hashed on open anyway. The key ties the log to one manifest, so another
attempt's leftovers never validate.
"""

from __future__ import annotations

import hashlib
import os
import struct
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent.protocol.manifest import DeployManifest

RECORD = struct.Struct("<II")


def log_key(manifest: DeployManifest) -> bytes:
    """What every record's CRC covers besides its index: the manifest's SHA-256, size and chunk list."""
    text = f"{manifest.sha256}\n{manifest.size}\n{manifest.chunk_size}\n" + "\n".join(manifest.chunks)
    return hashlib.sha256(text.encode()).digest()


def encode_records(key: bytes, indexes: Iterable[int]) -> bytes:
    """The records naming ``indexes``, in that order."""
    return b"".join(RECORD.pack(i, zlib.crc32(key + i.to_bytes(4, "little"))) for i in indexes)


def decode_records(key: bytes, data: bytes, chunk_count: int) -> list[int]:
    """The indexes the valid records of ``data`` name, up to the first short or invalid record."""
    indexes: list[int] = []
    for offset in range(0, len(data) - RECORD.size + 1, RECORD.size):
        index, crc = RECORD.unpack_from(data, offset)
        if index >= chunk_count or crc != zlib.crc32(key + index.to_bytes(4, "little")):
            break
        indexes.append(index)
    return indexes


def read_log(path: Path, manifest: DeployManifest) -> list[int]:
    """The chunks the log at ``path`` names (none when it is missing or unreadable)."""
    try:
        data = path.read_bytes()
    except OSError:
        return []
    return decode_records(log_key(manifest), data, len(manifest.chunks))


class ChunkLog:
    """The open log of one download: appended by flushes, emptied when the bitmap is rewritten."""

    def __init__(self, path: Path, manifest: DeployManifest) -> None:
        self.path = path
        self._key = log_key(manifest)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def append(self, indexes: Iterable[int]) -> None:
        """Record ``indexes`` durably: one write, one fdatasync (the file's new size included)."""
        view = memoryview(encode_records(self._key, indexes))
        while view:
            view = view[os.write(self._fd, view) :]
        _datasync(self._fd)

    def clear(self) -> None:
        """Empty the log; only after a durable bitmap names everything it named."""
        os.ftruncate(self._fd, 0)
        _datasync(self._fd)

    def close(self) -> None:
        """Close the log file."""
        os.close(self._fd)


def _datasync(fd: int) -> None:
    if hasattr(os, "fdatasync"):
        os.fdatasync(fd)
    else:
        os.fsync(fd)
