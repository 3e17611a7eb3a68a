"""``fleet bundle``'s file: the signed index, then each member streamed from disk into a tar.

Nothing is held in memory but the index and the desired states: every carried file is copied from
where the controller keeps it (its models directory, or another directory named with ``--from``)
straight into the tar, and the tar is written to ``OUT.part``, fsynced and renamed, so a half-written
bundle never has the name the operator carries away.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from agent.errors import UsageError
from agent.fleet.bundle.retained import Published
from agent.fleet.engines.store import EngineStore, StoredEngine
from agent.fsutil import fsync_directory, sha256_file
from agent.protocol.delivery_errors import RejectedError
from agent.protocol.engines import EngineRecord
from agent.protocol.manifest import DeployManifest, read_envelope, read_manifest
from agent.signing import Ed25519PrivateKey
from agent.trust.bundle import (
    INDEX_MEMBER,
    MAX_ENGINES_PER_DEVICE,
    BundleIndex,
    CarriedFile,
    DesiredEntry,
    signed_index,
)

_COPY_BUFFER = 1024 * 1024
#: Largest ``up/info`` read for its platform (a device's own report: a larger one is not read).
MAX_INFO_BYTES = 1024 * 1024
#: The platform facts an engine's identity pins, as ``up/info`` reports them.
_PLATFORM_FACTS = ("gpu_name", "compute_capability", "l4t_release", "machine")


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


def device_platform(info: bytes | None) -> dict[str, object]:
    """The ``platform`` a device's retained ``up/info`` reports (empty when absent or unreadable)."""
    if info is None or len(info) > MAX_INFO_BYTES:
        return {}
    try:
        platform = json.loads(info).get("platform")
    except (ValueError, AttributeError):
        return {}
    return platform if isinstance(platform, dict) else {}


def built_for(record: EngineRecord, platform: dict[str, object]) -> bool:
    """Whether ``record``'s engine was built for this platform: its identity's backend version, GPU,
    compute capability, L4T release and machine are the ones the device reports."""
    identity = record.meta.get("identity")
    if not platform or not isinstance(identity, dict):
        return False
    backend = identity.get("backend")
    if platform.get(f"{backend}_version") != identity.get("backend_version"):
        return False
    return all(platform.get(fact) == identity.get(fact) for fact in _PLATFORM_FACTS)


def shared_engines(published: Published, store: EngineStore) -> dict[str, list[StoredEngine]]:
    """Per device whose desired states share engines, the engines ``store`` holds for those models on
    its platform (most recently used first, at most :data:`MAX_ENGINES_PER_DEVICE`)."""
    found: dict[str, list[StoredEngine]] = {}
    entries = store.entries()
    for device, targets in sorted(published.desired.items()):
        manifests = [_manifest(payload, device, target) for target, payload in targets.items()]
        models = {(m.model_id, m.version) for m in manifests if m.share_engines}
        platform = device_platform(published.info.get(device))
        mine = [e for e in entries if (e.model_id, e.version) in models and built_for(e.record, platform)]
        if mine:
            found[device] = mine[:MAX_ENGINES_PER_DEVICE]
    return found


def engine_files(engines: Mapping[str, Sequence[StoredEngine]], store: EngineStore) -> dict[str, Path]:
    """Where each carried engine's files are in the store; raises UsageError naming a missing one."""
    files: dict[str, Path] = {}
    for entries in engines.values():
        for entry in entries:
            for file in entry.record.files:
                path = store.blob_path(file.sha256)
                if not path.is_file():
                    raise UsageError(
                        f"engine {entry.record.key[:12]}: its file {file.name} ({file.sha256}) is not in "
                        f"{store.blobs}; it was evicted while the bundle was made, run fleet bundle again"
                    )
                files[file.sha256] = path
    return files


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


def make_index(
    published: Published,
    files: Mapping[str, Path],
    engines: Mapping[str, Sequence[StoredEngine]] | None = None,
) -> BundleIndex:
    """The index of a bundle carrying ``published``, ``engines`` and ``files``, in the order they are
    written (``files`` holds the engines' files too)."""
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
        engines={
            device: [entry.signed for entry in entries] for device, entries in sorted((engines or {}).items())
        },
    )


def write_bundle(
    out: Path,
    published: Published,
    files: Mapping[str, Path],
    *,
    key: Ed25519PrivateKey,
    key_id: str,
    engines: Mapping[str, Sequence[StoredEngine]] | None = None,
) -> BundleSummary:
    """Write the bundle to ``out`` (temp + fsync + rename): index (with the shared engines' signed
    records), root chain, desired states, files."""
    index = make_index(published, files, engines)
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
