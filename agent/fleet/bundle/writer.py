"""``fleet bundle``'s file: the signed index, then each member streamed from disk into a tar.

Nothing is held in memory but the index and the desired states: every carried file is copied from
where the controller keeps it (its models directory, or another directory named with ``--from``)
straight into the tar, and the tar is written to ``OUT.part``, fsynced and renamed, so a half-written
bundle never has the name the operator carries away.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from agent.errors import UsageError
from agent.fleet.bundle.retained import Published
from agent.fsutil import fsync_directory, sha256_file
from agent.protocol.delivery_errors import RejectedError
from agent.protocol.manifest import DeployManifest, read_envelope, read_manifest
from agent.signing import Ed25519PrivateKey
from agent.trust.bundle import (
    INDEX_MEMBER,
    BundleIndex,
    CarriedFile,
    DesiredEntry,
    signed_index,
)

_COPY_BUFFER = 1024 * 1024


@dataclass(frozen=True)
class BundleSummary:
    """What was written: the index and the file's size."""

    index: BundleIndex
    path: Path
    size: int


def needed_files(published: Published) -> dict[str, int]:
    """The SHA-256 and size of every file the desired states name (model or document, and artifacts)."""
    return {
        sha256: size
        for device, targets in published.desired.items()
        for target, payload in targets.items()
        for sha256, size in _files_of(_manifest(payload, device, target))
    }


def _manifest(payload: bytes, device: str, target: str) -> DeployManifest:
    try:
        envelope, job_id = read_envelope(payload)
        return read_manifest(envelope, job_id, device)
    except RejectedError as exc:
        raise UsageError(
            f"the retained desired state of {device}'s {target!r} cannot be read: {exc}"
        ) from exc


def _files_of(manifest: DeployManifest) -> Iterable[tuple[str, int]]:
    yield manifest.sha256, manifest.size
    for artifact in manifest.artifacts or ():
        yield artifact.sha256, artifact.size


def find_files(needed: Mapping[str, int], directories: Sequence[Path]) -> dict[str, Path]:
    """Where each needed file is: by its store name (``<sha256>.onnx``, ``<sha256>``) first, then any
    file of the right size whose content hashes to it. Raises UsageError naming what is missing."""
    found: dict[str, Path] = {}
    for sha256 in needed:
        for directory in directories:
            for name in (f"{sha256}.onnx", sha256):
                path = directory / name
                if path.is_file() and sha256_file(path) == sha256:
                    found[sha256] = path
    sizes = {size for sha256, size in needed.items() if sha256 not in found}
    for directory in directories:
        if not sizes or not directory.is_dir():
            continue
        for path in sorted(directory.rglob("*")):
            if path.is_file() and path.stat().st_size in sizes:
                sha256 = sha256_file(path)
                if sha256 in needed and sha256 not in found:
                    found[sha256] = path
    missing = sorted(set(needed) - set(found))
    if missing:
        raise UsageError(
            f"the bytes of {len(missing)} file(s) the desired states name are not found in "
            f"{', '.join(str(d) for d in directories)} (first: sha256 {missing[0]}); name the directory "
            "holding the deployed model or artifact with --from"
        )
    return found


def make_index(published: Published, files: Mapping[str, Path]) -> BundleIndex:
    """The index of a bundle carrying ``published`` and ``files``, in the order they are written."""
    devices = {
        device: [
            DesiredEntry(target=target, sha256=hashlib.sha256(payload).hexdigest(), size=len(payload))
            for target, payload in sorted(targets.items())
        ]
        for device, targets in sorted(published.desired.items())
    }
    chain = published.root_chain
    return BundleIndex(
        format=1,
        created_at=datetime.now(timezone.utc),
        devices=devices,
        root_chain=CarriedFile(sha256=hashlib.sha256(chain).hexdigest(), size=len(chain)) if chain else None,
        blobs=[
            CarriedFile(sha256=sha256, size=path.stat().st_size) for sha256, path in sorted(files.items())
        ],
    )


def write_bundle(
    out: Path, published: Published, files: Mapping[str, Path], *, key: Ed25519PrivateKey, key_id: str
) -> BundleSummary:
    """Write the bundle to ``out`` (temp + fsync + rename): index, root chain, desired states, files."""
    index = make_index(published, files)
    part = out.with_name(out.name + ".part")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(part, "wb") as raw:
        with tarfile.open(fileobj=raw, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            _add_bytes(tar, INDEX_MEMBER, signed_index(index, key, key_id))
            for name, carried in index.members():
                if name.startswith("blobs/"):
                    _add_file(tar, name, files[carried.sha256], carried.size)
                elif carried is index.root_chain:
                    assert published.root_chain is not None
                    _add_bytes(tar, name, published.root_chain)
                else:
                    device, target = name.split("/")[1:]
                    _add_bytes(tar, name, published.desired[device][target])
        raw.flush()
        os.fsync(raw.fileno())
    os.replace(part, out)
    fsync_directory(out.parent)
    return BundleSummary(index=index, path=out, size=out.stat().st_size)


def _info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = int(time.time())
    info.mode = 0o644
    return info


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    tar.addfile(_info(name, len(data)), io.BytesIO(data))


def _add_file(tar: tarfile.TarFile, name: str, path: Path, size: int) -> None:
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size != size:
            raise UsageError(f"{path} changed while the bundle was written; run fleet bundle again")
        tar.addfile(_info(name, size), f)
