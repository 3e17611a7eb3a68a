"""The root's versions as files in the operator's trust directory (``root/{N}.root.json``), each written
temp + fsync + rename.

``init`` makes version 1 and its keys; ``rotate`` and ``revoke`` make the next version unsigned;
``sign`` adds one root key's signature to the newest. Nothing here touches the network: these are the
offline steps, for a laptop with the root keys on a stick.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from tuf.api.metadata import Metadata, Root

from agent.errors import UsageError
from agent.fleet.trust.keyring import make_key, public_key, signer
from agent.fsutil import atomic_write_bytes
from agent.protocol.messages import MAX_ROOT_VERSIONS, RootChain
from agent.trust.roles import CONTROLLER, FLEET_ROLES, RELEASE, REVOKED_FIELD, ROOT, UNUSED, revoked_keys
from agent.trust.root import check_self_signed, read_root


@dataclass(frozen=True)
class TrustDir:
    """An operator's trust directory: ``keys/`` (the key files) and ``root/`` (every root version)."""

    path: Path

    @property
    def keys(self) -> Path:
        return self.path / "keys"

    @property
    def roots(self) -> Path:
        return self.path / "root"

    def version_file(self, version: int) -> Path:
        return self.roots / f"{version}.root.json"

    def versions(self) -> list[int]:
        """The root versions kept, oldest first."""
        if not self.roots.is_dir():
            return []
        return sorted(int(p.name.split(".", 1)[0]) for p in self.roots.glob("*.root.json"))

    def newest(self) -> Metadata[Root]:
        versions = self.versions()
        if not versions:
            raise UsageError(f"{self.path}: no root yet; run `edge-agent fleet trust init --dir {self.path}`")
        return read_root(self.version_file(versions[-1]).read_bytes(), str(self.version_file(versions[-1])))

    def write(self, root: Metadata[Root]) -> Path:
        path = self.version_file(root.signed.version)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, root.to_bytes(), mode=0o644)
        return path

    def chain(self) -> RootChain:
        """Every kept version, oldest first (the newest :data:`MAX_ROOT_VERSIONS`), for the devices."""
        versions = self.versions()[-MAX_ROOT_VERSIONS:]
        return RootChain(roots=[json.loads(self.version_file(v).read_bytes()) for v in versions])


def _expiry(days: float) -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0) + timedelta(days=days)


def init(directory: Path, *, root_keys: int, threshold: int, expires_days: float) -> Metadata[Root]:
    """Make the keys (``root-1..N``, ``release``, ``controller``) and root version 1, signed by every
    root key."""
    if not 1 <= threshold <= root_keys:
        raise UsageError(f"--threshold must be between 1 and --root-keys ({root_keys}), got {threshold}")
    trust = TrustDir(directory)
    if trust.versions():
        raise UsageError(f"{directory} already holds a root; `fleet trust rotate` makes the next version")
    names = [f"root-{i}" for i in range(1, root_keys + 1)]
    files = {name: make_key(trust.keys, name) for name in [*names, "release", "controller"]}
    root = Root(version=1, expires=_expiry(expires_days))
    for name in names:
        root.add_key(public_key(files[name].public), ROOT)
    root.add_key(public_key(files["release"].public), RELEASE)
    for role in (CONTROLLER, UNUSED):
        root.add_key(public_key(files["controller"].public), role)
    root.roles[ROOT].threshold = threshold
    metadata = Metadata(root)
    for name in names:
        metadata.sign(signer(files[name].private), append=True)
    trust.write(metadata)
    return metadata


def _next(trust: TrustDir, expires_days: float) -> Metadata[Root]:
    current = trust.newest()
    check_self_signed(current, "newest root")
    root = Root.from_dict(current.signed.to_dict())
    root.version += 1
    root.expires = _expiry(expires_days)
    return Metadata(root)


def rotate(
    directory: Path,
    *,
    role: str,
    add: list[Path],
    remove: list[str],
    threshold: int | None,
    expires_days: float,
) -> Metadata[Root]:
    """The next root version, unsigned: ``role``'s keys with ``add`` (key files) and without ``remove``
    (key ids); a renewed expiry even with no key change."""
    trust = TrustDir(directory)
    metadata = _next(trust, expires_days)
    root = metadata.signed
    tuf_roles = [FLEET_ROLES[role]] + ([UNUSED] if role == "controller" else [])
    for tuf_role in tuf_roles:
        for path in add:
            root.add_key(public_key(path), tuf_role)
        for key_id in remove:
            if key_id not in root.roles[tuf_role].keyids:
                raise UsageError(f"key {key_id} is not a {role} key of root version {root.version - 1}")
            root.revoke_key(key_id, tuf_role)
        if threshold is not None:
            root.roles[tuf_role].threshold = threshold
    _check_thresholds(root)
    trust.write(metadata)
    return metadata


def revoke(directory: Path, key_id: str, *, expires_days: float) -> Metadata[Root]:
    """The next root version, unsigned: ``key_id`` out of every role and on the revoked list for good."""
    trust = TrustDir(directory)
    metadata = _next(trust, expires_days)
    root = metadata.signed
    held = [r for r, role in root.roles.items() if key_id in role.keyids]
    if not held and key_id not in root.keys:
        raise UsageError(f"no key {key_id} in the newest root (`edge-agent fleet trust show` lists them)")
    for role in held:
        root.revoke_key(key_id, role)
    root.unrecognized_fields[REVOKED_FIELD] = sorted(revoked_keys(Metadata(root)) | {key_id})
    _check_thresholds(root)
    trust.write(metadata)
    return metadata


def _check_thresholds(root: Root) -> None:
    for name, role in root.roles.items():
        if len(role.keyids) < role.threshold:
            raise UsageError(
                f"role {name!r} would keep {len(role.keyids)} key(s) for a threshold of {role.threshold}; "
                "add keys first (`fleet trust rotate --add`)"
            )


def sign(directory: Path, key: Path) -> Metadata[Root]:
    """Add the root key ``key``'s signature to the newest root version."""
    trust = TrustDir(directory)
    metadata = trust.newest()
    key_signer = signer(key)
    versions = trust.versions()
    allowed = set(metadata.signed.roles[ROOT].keyids)
    if len(versions) > 1:
        previous = read_root(trust.version_file(versions[-2]).read_bytes())
        allowed |= set(previous.signed.roles[ROOT].keyids)
    if key_signer.public_key.keyid not in allowed:
        raise UsageError(f"{key} is not a root key of this version or the one before; nothing signed")
    metadata.sign(key_signer, append=True)
    trust.write(metadata)
    return metadata
