"""A bundle file read as a stream: its index first, then each member exactly as the index lists it.

The reader never loads a member it was not told to keep and never trusts a member's header: the
name must be the next one the index lists (so no path of the file's choosing is ever used), the
member a regular file of the listed size, and its bytes must hash to the listed SHA-256. A file
that ends early is reported as truncated.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from agent.trust.bundle import INDEX_MEMBER, MAX_INDEX_BYTES, BundleError, CarriedFile

_COPY_BUFFER = 1024 * 1024


@dataclass(frozen=True)
class Member:
    """One member as the stream reaches it: the listed name and content, and its bytes to read once."""

    name: str
    carried: CarriedFile
    _tar: tarfile.TarFile
    _info: tarfile.TarInfo

    def read(self, limit: int) -> bytes:
        """The member's bytes (at most ``limit``), checked against the index."""
        if self.carried.size > limit:
            raise BundleError(f"{self.name}: {self.carried.size} bytes, more than the {limit} allowed")
        try:
            data = _open(self._tar, self._info, self.name).read(self.carried.size + 1)
        except (tarfile.TarError, EOFError) as exc:
            raise _cut(self.name, exc) from exc
        self._check(hashlib.sha256(data).hexdigest(), len(data))
        return data

    def copy_to(self, path: Path) -> None:
        """Stream the member into ``path`` (fsynced), checked against the index; removed if it fails."""
        source = _open(self._tar, self._info, self.name)
        digest = hashlib.sha256()
        size = 0
        try:
            with open(path, "wb") as out:
                while block := source.read(_COPY_BUFFER):
                    digest.update(block)
                    size += len(block)
                    out.write(block)
                out.flush()
                os.fsync(out.fileno())
            self._check(digest.hexdigest(), size)
        except (tarfile.TarError, EOFError) as exc:
            path.unlink(missing_ok=True)
            raise _cut(self.name, exc) from exc
        except BaseException:
            path.unlink(missing_ok=True)
            raise

    def _check(self, sha256: str, size: int) -> None:
        if size != self.carried.size:
            raise BundleError(f"{self.name}: {size} bytes where the signed index lists {self.carried.size}")
        if sha256 != self.carried.sha256:
            raise BundleError(
                f"{self.name}: its bytes hash to {sha256}, not the {self.carried.sha256} the signed index "
                "lists; the file was altered or damaged (copy it again from the operator)"
            )


def _cut(name: str, exc: BaseException) -> BundleError:
    return BundleError(
        f"{name}: the file ends inside it ({exc}): truncated (copy it again from the operator)"
    )


def _open(tar: tarfile.TarFile, info: tarfile.TarInfo, name: str) -> IO[bytes]:
    stream = tar.extractfile(info)
    if stream is None:
        raise BundleError(f"{name}: not a regular file")
    return stream


class BundleStream:
    """The members of one bundle file in order; use as a context manager."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._raw: IO[bytes] | None = None
        self._tar: tarfile.TarFile | None = None
        self._members: Iterator[tarfile.TarInfo] | None = None

    def __enter__(self) -> BundleStream:
        try:
            self._raw = open(self.path, "rb")  # closed by __exit__
            self._tar = tarfile.open(fileobj=self._raw, mode="r|")
        except OSError as exc:
            self.__exit__()
            raise BundleError(f"{self.path}: cannot read it ({exc.strerror or exc})") from exc
        except tarfile.TarError as exc:
            self.__exit__()
            raise BundleError(f"{self.path}: not a bundle (not a tar file: {exc})") from exc
        self._members = iter(self._tar)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._tar is not None:
            self._tar.close()
        if self._raw is not None:
            self._raw.close()

    def index_bytes(self) -> bytes:
        """The first member, the signed index (bounded)."""
        info = self._next(INDEX_MEMBER)
        if info.size > MAX_INDEX_BYTES:
            raise BundleError(f"{INDEX_MEMBER}: larger than {MAX_INDEX_BYTES} bytes")
        assert self._tar is not None
        return _open(self._tar, info, INDEX_MEMBER).read(MAX_INDEX_BYTES + 1)

    def member(self, name: str, carried: CarriedFile) -> Member:
        """The next member, which must be ``name`` with ``carried``'s size."""
        info = self._next(name)
        if info.size != carried.size:
            raise BundleError(f"{name}: {info.size} bytes where the signed index lists {carried.size}")
        assert self._tar is not None
        return Member(name, carried, self._tar, info)

    def end(self) -> None:
        """Raise unless the file holds nothing after the last listed member."""
        extra = self._advance("the end of the bundle")
        if extra is not None:
            raise BundleError(f"{_shown(extra.name)}: a member the signed index does not list; refused")

    def _next(self, name: str) -> tarfile.TarInfo:
        info = self._advance(name)
        if info is None:
            raise BundleError(
                f"{self.path}: the file ends before {name}: truncated (copy it again from the operator)"
            )
        if info.name != name:
            if _escapes(info.name):
                raise BundleError(f"{_shown(info.name)}: a path outside the bundle (path traversal); refused")
            raise BundleError(
                f"{_shown(info.name)}: not the member the signed index lists next ({name}); refused"
            )
        if not info.isreg():
            raise BundleError(f"{name}: not a regular file (links and devices are refused)")
        return info

    def _advance(self, what: str) -> tarfile.TarInfo | None:
        assert self._members is not None
        try:
            return next(self._members, None)
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise BundleError(
                f"{self.path}: unreadable before {what} ({exc}): truncated or damaged (copy it again)"
            ) from exc


def _escapes(name: str) -> bool:
    return name.startswith("/") or ".." in Path(name).parts


def _shown(name: str) -> str:
    return repr(name[:200])
