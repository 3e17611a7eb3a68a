"""Model uploads to the controller's repository, in pieces over the broker.

``fleet rollout start`` runs where the operator is, the controller where its state is: the model
travels as ``upload`` requests of at most :data:`PIECE_SIZE` bytes each (the payload is the bytes;
user properties ``sha256``, ``offset``, ``size`` say where they go), each answered before the next is
sent. The pieces are written into ``models/.upload-{sha256}.part``; the last one makes the file
whole, it is fsynced, hashed, and renamed to ``models/{sha256}.onnx``: a model in the repository is
always complete and has the hash it is named by. A piece that does not fit (wrong offset, a size that
changed, a hash that does not match at the end) is refused with the reason, and the partial file of
a mismatch removed. A piece that cannot be written (a full disk) is refused and none of it kept: a
first piece leaves no partial file behind.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from agent.errors import AgentError
from agent.fsutil import fsync_directory, sha256_file

#: Bytes per upload request: well under any broker's packet limit, few round trips for a 5 MB model.
PIECE_SIZE = 1024 * 1024
#: The largest model the controller takes by upload (bigger ones: copy them into models/ yourself).
MAX_MODEL_BYTES = 4 * 1024**3
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class UploadError(AgentError):
    """An upload piece the controller refuses."""

    code = "upload"


class UploadSink:
    """Writes upload pieces into ``models_dir`` (see the module docstring)."""

    def __init__(self, models_dir: Path) -> None:
        self.models_dir = Path(models_dir)

    def take(self, data: bytes, properties: dict[str, str]) -> dict[str, Any]:
        """Write one piece; ``{"have": bytes so far, "complete": bool}``."""
        sha = properties.get("sha256", "")
        if not _SHA256.match(sha):
            raise UploadError("upload: user property sha256 must be 64 lowercase hex digits")
        try:
            offset = int(properties.get("offset", ""))
            size = int(properties.get("size", ""))
        except ValueError as exc:
            raise UploadError("upload: user properties offset and size must be integers") from exc
        if not 0 < size <= MAX_MODEL_BYTES:
            raise UploadError(f"upload: size {size} is outside 1..{MAX_MODEL_BYTES} bytes")
        final = self.models_dir / f"{sha}.onnx"
        if final.is_file():
            return {"have": final.stat().st_size, "complete": True}
        part = self.models_dir / f".upload-{sha}.part"
        have = part.stat().st_size if part.exists() else 0
        if offset not in (have, 0):
            raise UploadError(
                f"upload {sha[:12]}: piece at offset {offset}, but {have} bytes are here; resend from {have}"
            )
        if offset + len(data) > size:
            raise UploadError(f"upload {sha[:12]}: piece ends at {offset + len(data)}, past the size {size}")
        self.models_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if offset == 0 else 0), 0o644)
        try:
            _write_piece(fd, data, offset, last=offset + len(data) == size)
        except OSError as exc:
            # A full disk (or an I/O error): none of this piece is kept, so "have" stays what the
            # client was told, and a first piece leaves no file behind.
            if offset == 0:
                part.unlink(missing_ok=True)
            else:
                os.truncate(part, offset)
            raise UploadError(
                f"upload {sha[:12]}: cannot write the piece at offset {offset} into {self.models_dir} "
                f"({exc.strerror or exc}); nothing of it was kept; free space there and upload again"
            ) from exc
        finally:
            os.close(fd)
        have = offset + len(data)
        if have < size:
            return {"have": have, "complete": False}
        actual = sha256_file(part)
        if actual != sha:
            part.unlink()
            raise UploadError(f"upload: the bytes hash to {actual}, not {sha}; nothing kept")
        os.replace(part, final)
        fsync_directory(self.models_dir)
        return {"have": size, "complete": True}


def _write_piece(fd: int, data: bytes, offset: int, *, last: bool) -> None:
    """Write all of ``data`` at ``offset`` (pwrite may write part of it), fsynced when ``last``."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
    if last:
        os.fsync(fd)
