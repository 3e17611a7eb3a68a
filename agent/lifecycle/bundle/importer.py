"""``edge-agent import FILE``: a bundle checked by this device's trust rules, its bytes put in the
device's stores and its desired states handed to the agent.

The steps, in the file's order: the signed index; the root chain, taken on trial (nothing is
written) so a device offline since before a rotation checks the index against the newest root the
rules allow; the index's signature by a controller key of that root (or, without a root, one of
``delivery.trusted_keys``); this device's desired states, each checked as the desired-state intake
checks one (:func:`~agent.trust.deployment.checked_release`, or
:func:`~agent.protocol.manifest.parse_signed`); then the files they name, streamed into a staging
directory and checked against the signed index. Only when the whole file passed are the files moved
into the stores (by SHA-256, each hashed again) and the desired states kept for the agent
(:mod:`.inbox`), which is signalled when it runs. A refusal at any step changes nothing.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import structlog
from tuf.api.metadata import Metadata, Root

from agent.config.models import AgentConfig
from agent.engines.sharing.imported import ImportedEngines
from agent.engines.sharing.trust import EngineRefusedError, verified_record
from agent.errors import AgentError, DiskFullError
from agent.lifecycle.bundle.inbox import ImportedStates
from agent.lifecycle.bundle.reader import BundleStream
from agent.protocol.delivery_errors import RejectedError
from agent.protocol.device_targets import DEVICE_TARGETS
from agent.protocol.engines import EngineRecord, SignedEngine
from agent.protocol.manifest import DeployManifest, parse_signed
from agent.protocol.messages import MAX_ROOT_CHAIN_BYTES
from agent.signing import Ed25519PublicKey, load_public_key
from agent.state.lock import holder_pid
from agent.store import ModelStore
from agent.trust.anchor import FleetRoot, adopted_root
from agent.trust.bundle import (
    INDEX_MEMBER,
    MAX_DESIRED_BYTES,
    ROOT_MEMBER,
    BundleError,
    check_index_signature,
    desired_member,
    read_index,
)
from agent.trust.deployment import checked_release
from agent.trust.root import RootRefusedError, newest_root

log = structlog.get_logger(__name__)

#: Where the agent keeps the root versions it took (as the delivery service does).
_KEPT_ROOT = Path("trust") / "root.json"


@dataclass(frozen=True)
class ImportedTarget:
    """One desired state handed to the agent."""

    target: str
    job_id: str
    version: str


@dataclass
class ImportReport:
    """What an import did."""

    device: str
    targets: list[ImportedTarget] = field(default_factory=list)
    root_version: int | None = None
    copied: int = 0
    present: int = 0
    copied_bytes: int = 0
    engines: int = 0
    signalled: int | None = None

    def as_dict(self) -> dict[str, object]:
        """For ``import --json``."""
        return {
            "device": self.device,
            "targets": [t.__dict__ for t in self.targets],
            "root_version": self.root_version,
            "files_copied": self.copied,
            "files_present": self.present,
            "bytes_copied": self.copied_bytes,
            "engines": self.engines,
            "agent_signalled": self.signalled,
        }


@dataclass
class _DeviceTrust:
    """What this device trusts now: its fleet root (if any) and its trusted keys."""

    root: Metadata[Root] | None
    trusted: dict[str, Ed25519PublicKey]
    require_signature: bool


def _device_trust(config: AgentConfig) -> _DeviceTrust:
    delivery = config.delivery
    kept = config.state_dir / _KEPT_ROOT
    try:
        trusted = {key_id: load_public_key(path) for key_id, path in delivery.trusted_keys.items()}
        anchor = delivery.trust_root if delivery.trust_root is not None else (kept if kept.exists() else None)
        root = FleetRoot(anchor, kept).current() if anchor is not None else None
    except (OSError, ValueError) as exc:
        raise AgentError(f"this device's trust settings cannot be read: {exc}") from exc
    return _DeviceTrust(root, trusted, delivery.require_signature)


def _trial_root(trust: _DeviceTrust, chain: bytes) -> Metadata[Root] | None:
    """The root this device would hold after taking ``chain`` (nothing written)."""
    if trust.root is None:
        with tempfile.TemporaryDirectory() as scratch:
            adopted = adopted_root(chain, trust.trusted, Path(scratch) / "root.json")
            return adopted.current() if adopted is not None else None
    try:
        root, refused = newest_root(trust.root, FleetRoot.read_chain(chain))
    except RootRefusedError as exc:
        raise BundleError(f"{ROOT_MEMBER}: the root chain is refused ({exc.code}): {exc}") from exc
    for why in refused:
        log.warning("bundle.root.version_refused", code=why.code, error=str(why))
    return root


def _checked(
    payload: bytes, target: str, trust: _DeviceTrust, config: AgentConfig, now: datetime
) -> DeployManifest:
    """``payload`` checked as the desired-state intake checks one arriving on ``target``'s topic."""
    name = desired_member(config.device_id, target)
    try:
        if trust.root is not None:
            manifest = checked_release(trust.root, payload, config.device_id, now)[0]
        else:
            manifest = parse_signed(payload, trust.trusted, trust.require_signature, config.device_id)
    except RejectedError as exc:
        raise BundleError(f"{name}: the desired state is refused ({exc.code}): {exc}") from exc
    if manifest.slot != target:
        raise BundleError(f"{name}: the manifest is for {manifest.slot!r}, not {target!r}; refused")
    if target not in DEVICE_TARGETS and target not in config.slots:
        raise BundleError(f"{name}: this device has no slot {target!r}; configure it under slots: first")
    return manifest


def _checked_engines(
    signed: list[SignedEngine], trust: _DeviceTrust, device: str
) -> list[tuple[EngineRecord, SignedEngine]]:
    """Each shared engine carried for ``device``, its signature checked as the engine cache checks one
    the fleet sends (its identity is checked when a build asks for its key)."""
    checked = []
    for n, engine in enumerate(signed):
        try:
            checked.append((verified_record(engine, trust.trusted), engine))
        except EngineRefusedError as exc:
            raise BundleError(f"{INDEX_MEMBER}: engines[{device}][{n}] is refused: {exc}") from exc
    return checked


def import_bundle(path: Path, config: AgentConfig, *, now: datetime | None = None) -> ImportReport:
    """Check the bundle at ``path`` for this device and hand it over; :class:`BundleError` (or another
    AgentError) names what was wrong, and then nothing was changed."""
    now = now or datetime.now(timezone.utc)
    trust = _device_trust(config)
    report = ImportReport(device=config.device_id)
    models = ModelStore(config.state_dir / "models")
    artifacts = ModelStore(config.state_dir / "artifacts")
    imported_engines = ImportedEngines(config.state_dir)
    staging = config.state_dir / "partial" / f"bundle-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        with BundleStream(path) as stream:
            signed, index = read_index(stream.index_bytes())
            members = iter(index.members())
            chain = None
            if index.root_chain is not None:
                chain = stream.member(*next(members)).read(MAX_ROOT_CHAIN_BYTES)
                root = _trial_root(trust, chain)
                if root is not None:
                    trust.root = root
            check_index_signature(signed, root=trust.root, trusted=trust.trusted)
            mine = index.devices.get(config.device_id)
            if mine is None:
                raise BundleError(
                    f"this bundle is for {', '.join(sorted(index.devices)) or 'no device'}, not for this "
                    f"device ({config.device_id}); make one with `edge-agent fleet bundle --device "
                    f"{config.device_id}`"
                )
            desired: dict[str, bytes] = {}
            wanted: dict[str, ModelStore] = {}
            for device, entries in index.devices.items():
                for entry in entries:
                    member = stream.member(*next(members))
                    if device != config.device_id:
                        continue  # another device's: the stream skips its bytes
                    payload = member.read(MAX_DESIRED_BYTES)
                    manifest = _checked(payload, entry.target, trust, config, now)
                    desired[entry.target] = payload
                    report.targets.append(ImportedTarget(entry.target, manifest.job_id, manifest.version))
                    wanted[manifest.sha256] = models
                    for artifact in manifest.artifacts or ():
                        wanted[artifact.sha256] = artifacts
            engines = _checked_engines(index.engines.get(config.device_id, []), trust, config.device_id)
            for record, _ in engines:
                for engine_file in record.files:
                    wanted.setdefault(engine_file.sha256, imported_engines.files)
            carried = {blob.sha256 for blob in index.blobs}
            lacking = sorted(
                sha for sha, store in wanted.items() if sha not in carried and not store.has(sha)
            )
            if lacking:
                raise BundleError(
                    f"the bundle lacks the file {lacking[0]} a desired state names, and this device does "
                    "not hold it; make the bundle again"
                )
            needed = [b for b in index.blobs if b.sha256 in wanted and not wanted[b.sha256].has(b.sha256)]
            models.check_free_space(sum(b.size for b in needed), config.delivery.disk_headroom_bytes)
            staging.mkdir(parents=True, exist_ok=True)
            staged: dict[str, Path] = {}
            for name, blob in members:
                member = stream.member(name, blob)
                if any(b.sha256 == blob.sha256 for b in needed):
                    member.copy_to(staging / blob.sha256)
                    staged[blob.sha256] = staging / blob.sha256
            stream.end()
        for sha256, file in staged.items():
            wanted[sha256].adopt(file, sha256)
            report.copied += 1
            report.copied_bytes += next(b.size for b in needed if b.sha256 == sha256)
        report.present = len(wanted) - report.copied
        imported_engines.keep(engines)
        report.engines = len(engines)
        ImportedStates(config.state_dir).keep(chain, desired)
    except DiskFullError as exc:
        raise BundleError(f"{path}: {exc}") from exc
    except OSError as exc:  # writing the device's stores (the bundle's own read errors are BundleErrors)
        raise BundleError(
            f"{path}: cannot write into {config.state_dir} ({exc.strerror or exc}); nothing was "
            "handed to the agent"
        ) from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    report.root_version = trust.root.signed.version if trust.root is not None else None
    report.signalled = _signal_agent(config.state_dir)
    log.info("bundle.imported", **report.as_dict())
    return report


def _signal_agent(state_dir: Path) -> int | None:
    """Tell the running agent (if any) to take the imported states; its pid, or None."""
    pid = holder_pid(state_dir)
    if pid is None or pid == os.getpid():
        return None
    try:
        os.kill(pid, signal.SIGUSR1)
    except OSError as exc:
        log.warning("bundle.agent.not_signalled", pid=pid, error=str(exc))
        return None
    return pid
