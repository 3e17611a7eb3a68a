"""Crash-safe file writes and file hashing.

Every file the agent persists (state.json, model files, engine sidecars) is written through
:func:`atomic_writer`: the data goes to a temporary file in the same directory, is flushed and
fsynced, then renamed over the target with :func:`os.replace`, and finally the directory is fsynced
so the rename itself survives a power cut. A reader therefore sees either the complete old file or
the complete new one, never a torn write, and a failure leaves no temporary file behind.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

#: Files are hashed in blocks of this size, so a model of any size needs constant memory.
HASH_BLOCK_SIZE = 1024 * 1024

#: Mode of a file created by an atomic write when no mode is given and no file existed before.
DEFAULT_FILE_MODE = 0o644


def fsync_directory(directory: Path) -> None:
    """Make a rename, creation or deletion inside ``directory`` durable.

    Some file systems (and some platforms) refuse to fsync a directory; that only weakens
    durability, never correctness, so that refusal is ignored.
    """
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing ``length`` bytes at ``offset`` of ``fd`` to disk now, without waiting for it.

    So that a later fdatasync finds them written, or on their way, instead of writing them all then.
    Linux's ``posix_fadvise(DONTNEED)`` does this: it starts the range's writeback and drops only
    pages already clean, so bytes just written stay in the page cache (the whole-file hash that
    follows a download reads them from memory). A no-op where the call is missing or refused: this
    only moves work earlier, durability still comes from the fsync.
    """
    if not hasattr(os, "posix_fadvise"):
        return
    with contextlib.suppress(OSError):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


@contextlib.contextmanager
def atomic_writer(path: Path, mode: int | None = None) -> Iterator[IO[bytes]]:
    """Open a binary file that replaces ``path`` atomically when the ``with`` block ends normally.

    If the block raises, the temporary file is removed, ``path`` is left untouched and the
    exception propagates. ``mode`` sets the new file's permissions; by default an existing file's
    permissions are kept, and a new file gets 0644 (``mkstemp`` would leave 0600).
    """
    path = Path(path)
    directory = path.parent
    if mode is None:
        try:
            mode = path.stat().st_mode & 0o7777
        except FileNotFoundError:
            mode = DEFAULT_FILE_MODE
    # The temporary file lives in the target's directory: os.replace is only atomic within one
    # file system. The leading dot keeps it out of casual listings and globs such as *.onnx.
    fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    fsync_directory(directory)


def atomic_write_bytes(path: Path, data: bytes, mode: int | None = None) -> None:
    """Replace ``path`` with ``data`` atomically (see :func:`atomic_writer`)."""
    with atomic_writer(path, mode) as f:
        f.write(data)


def atomic_write_text(path: Path, text: str, mode: int | None = None, encoding: str = "utf-8") -> None:
    """Replace ``path`` with ``text`` atomically, encoded as ``encoding`` (UTF-8 by default)."""
    atomic_write_bytes(path, text.encode(encoding), mode)


def atomic_write_json(
    path: Path,
    obj: Any,
    mode: int | None = None,
    default: Callable[[Any], Any] | None = None,
    indent: int | None = 2,
) -> None:
    """Replace ``path`` with ``obj`` as JSON atomically.

    The JSON is streamed into the temporary file, so a value that cannot be serialised (raising
    ``TypeError`` from ``default``, or ``ValueError`` for NaN/infinity, which are not JSON) fails the
    write part-way and leaves the old file in place. ``default`` converts values ``json`` does not know.
    """
    with atomic_writer(path, mode) as f:
        text = io.TextIOWrapper(f, encoding="utf-8", newline="\n")
        try:
            json.dump(obj, text, indent=indent, ensure_ascii=False, allow_nan=False, default=default)
            text.write("\n")
            text.flush()
        finally:
            # Detach so closing the wrapper does not close the file atomic_writer still owns.
            text.detach()


def sha256_file(path: Path) -> str:
    """Return the lowercase hex SHA-256 of the file at ``path``, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(HASH_BLOCK_SIZE), b""):
            digest.update(block)
    return digest.hexdigest()


def hash_chunks(path: Path, chunk_size: int) -> tuple[int, str, list[str]]:
    """``path``'s size, SHA-256 and the SHA-256 of each ``chunk_size`` piece, in one read: what a
    manifest or an engine offer tells a device to check every chunk against as it arrives."""
    whole = hashlib.sha256()
    chunks: list[str] = []
    size = 0
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(chunk_size), b""):
            whole.update(block)
            chunks.append(hashlib.sha256(block).hexdigest())
            size += len(block)
    return size, whole.hexdigest(), chunks
