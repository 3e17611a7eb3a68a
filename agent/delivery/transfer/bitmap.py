"""The ``<sha>.bitmap`` file of a partial download: which chunks are durable, and for which manifest.

A JSON object: a header that ties the bitmap to one manifest (format version, model SHA-256, size,
chunk size, and a digest of the chunk hash list) and ``done``, the hex of a bit per chunk (bit ``i``
of byte ``i // 8``). :func:`read_bitmap` answers None for a bitmap that does not describe the
manifest (another attempt's leftovers); :mod:`agent.delivery.transfer.flusher` writes it, only after
the chunks it names are on disk.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent.protocol.manifest import DeployManifest

BITMAP_VERSION = 1


def chunk_list_digest(chunks: list[str]) -> str:
    """SHA-256 over the manifest's chunk hashes: identifies the chunk layout a bitmap belongs to."""
    return hashlib.sha256("\n".join(chunks).encode()).hexdigest()


def empty_bits(chunk_count: int) -> bytearray:
    """A bitmap naming no chunk."""
    return bytearray((chunk_count + 7) // 8)


def set_bit(bits: bytearray, index: int) -> None:
    """Name chunk ``index`` in ``bits``."""
    bits[index >> 3] |= 1 << (index & 7)


def bitmap_header(manifest: DeployManifest) -> dict[str, Any]:
    """The fields that tie a bitmap to ``manifest``."""
    m = manifest
    return {
        "version": BITMAP_VERSION,
        "sha256": m.sha256,
        "size": m.size,
        "chunk_size": m.chunk_size,
        "chunks": chunk_list_digest(list(m.chunks)),
    }


def bitmap_record(manifest: DeployManifest, bits: bytearray) -> dict[str, Any]:
    """The bitmap file's content: the header and the chunks ``bits`` names."""
    return {**bitmap_header(manifest), "done": bits.hex()}


def read_bitmap(path: Path, manifest: DeployManifest) -> bytearray | None:
    """One byte per chunk (1 = durable) as the bitmap at ``path`` says, or None when it is missing,
    unreadable or does not describe ``manifest``."""
    chunk_count = len(manifest.chunks)
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            return None
        expected = bitmap_header(manifest)
        header = {k: data.get(k) for k in expected}
        if header != expected:
            return None
        bits = bytes.fromhex(str(data["done"]))
    except (OSError, ValueError, KeyError):
        return None
    if len(bits) != (chunk_count + 7) // 8:
        return None
    return bytearray((bits[i >> 3] >> (i & 7)) & 1 for i in range(chunk_count))
