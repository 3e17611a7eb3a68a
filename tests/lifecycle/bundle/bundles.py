"""Bundles made for the tests (no tests here): a fleet root made at run time (`fleet trust init`'s
keys, none spelled anywhere), released models, desired states signed with the controller key, and
bundle files written by the real writer; plus a hand-made tar for members no writer would make."""

from __future__ import annotations

import hashlib
import io
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.fleet.bundle.retained import Published
from agent.fleet.bundle.writer import find_files, needed_files, write_bundle
from agent.fleet.deploy.keys import load_signing_key
from agent.fleet.trust import versions
from agent.fleet.trust.keyring import key_id_of
from agent.fleet.trust.releases import sign_release
from agent.fleet.trust.versions import TrustDir
from agent.protocol.device_targets import AGENT_TARGET, CONFIG_TARGET, AgentRelease, AgentWheel
from agent.protocol.manifest import (
    KIB,
    DeployManifest,
    ManifestArtifact,
    build_manifest,
    describe_artifact,
    sign_manifest,
)
from agent.signing import Ed25519PrivateKey


@dataclass
class BundleTrust:
    """A trust directory made by ``fleet trust init`` for one test."""

    directory: Path

    @classmethod
    def init(cls, directory: Path) -> BundleTrust:
        versions.init(directory, root_keys=3, threshold=2, expires_days=30)
        return cls(directory)

    @property
    def controller_key(self) -> Path:
        return self.directory / "keys" / "controller.key"

    @property
    def release_key(self) -> Path:
        return self.directory / "keys" / "release.key"

    @property
    def anchor(self) -> Path:
        return self.directory / "root" / "1.root.json"

    def controller(self) -> tuple[Ed25519PrivateKey, str]:
        return load_signing_key(self.controller_key), key_id_of(self.controller_key)

    def chain(self) -> bytes:
        return TrustDir(self.directory).chain().model_dump_json().encode("utf-8")

    def desired(
        self,
        model: Path,
        *,
        device: str,
        version: str,
        slot: str = "cls",
        artifacts: list[ManifestArtifact] | None = None,
        released: bool = True,
        sequence: int | None = None,
        **fields: Any,
    ) -> tuple[DeployManifest, bytes]:
        """A desired state of ``model`` for ``device``, released with the release key (unless not
        ``released``) and signed with the controller key, as `fleet deploy --release` publishes it;
        ``fields`` are more of the manifest's (shadow, probation)."""
        manifest = build_manifest(
            model,
            job_id=f"bundle-{device}-{slot}-{version}",
            sequence=sequence if sequence is not None else int(version),
            slot=slot,
            model_id="cls",
            version=version,
            device=device,
            chunk_size=4 * KIB,
            artifacts=artifacts or (),
            **fields,
        )
        release = None
        if released:
            out = model.with_suffix(f".{slot}.{version}.release.json")
            release = sign_release(manifest, [self.release_key], out, version=1, expires_days=30).read_text()
        key, key_id = self.controller()
        return manifest, sign_manifest(manifest, key, key_id, release=release)


def write_test_bundle(
    out: Path,
    trust: BundleTrust,
    desired: dict[str, dict[str, bytes]],
    files_in: list[Path],
    *,
    key: tuple[Ed25519PrivateKey, str] | None = None,
    with_chain: bool = True,
) -> Path:
    """A bundle written by the real writer for ``desired``, its files found under ``files_in``."""
    published = Published(desired=desired, root_chain=trust.chain() if with_chain else None)
    files = find_files(needed_files(published), files_in)
    signing_key, key_id = key or trust.controller()
    write_bundle(out, published, files, key=signing_key, key_id=key_id)
    return out


def members(bundle: Path) -> list[tuple[str, bytes]]:
    """Every member of ``bundle`` and its bytes (small test bundles only)."""
    with tarfile.open(bundle, "r:") as tar:
        found = [(m, tar.extractfile(m)) for m in tar.getmembers() if m.isreg()]
        return [(m.name, f.read()) for m, f in found if f is not None]


def rewrite(
    bundle: Path, out: Path, replaced: dict[str, bytes], *, inserted: tuple[int, str, bytes] | None = None
) -> Path:
    """``bundle`` with some members' bytes replaced (names kept), maybe a member inserted at a position."""
    items = [(name, replaced.get(name, data)) for name, data in members(bundle)]
    if inserted is not None:
        position, name, data = inserted
        items.insert(position, (name, data))
    with tarfile.open(out, "w:", format=tarfile.PAX_FORMAT) as tar:
        for name, data in items:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def device_target_files(
    directory: Path, overlay_text: str = "logging:\n  level: debug\n"
) -> tuple[Path, Path, Path]:
    """A configuration overlay, an agent release document and its one wheel, as the operator makes them."""
    directory.mkdir(parents=True, exist_ok=True)
    overlay = directory / "overlay.yaml"
    overlay.write_text(overlay_text)
    wheel = directory / "edge_agent-9.9.9-py3-none-any.whl"
    wheel.write_bytes(b"PK\x03\x04" + hashlib.sha256(b"wheel").digest() * 64)
    release = AgentRelease(
        version="9.9.9",
        python="3.11",
        platforms=["x86_64", "aarch64"],
        wheels=[AgentWheel(filename=wheel.name, sha256=sha(wheel.read_bytes()), size=wheel.stat().st_size)],
    )
    document = directory / "release.json"
    document.write_text(release.model_dump_json())
    return overlay, document, wheel


def device_target_states(
    trust: BundleTrust, directory: Path, device: str, *, sequence: int = 1, **fields: Any
) -> dict[str, tuple[DeployManifest, bytes]]:
    """Released, signed ``_config`` and ``_agent`` desired states for ``device``, per the contract:
    the document is the manifest's bytes, each wheel an artifact of kind ``wheel``; ``overlay_text``
    is the overlay's, other ``fields`` more of the manifests' (``probation_s``)."""
    overlay, document, wheel = device_target_files(
        directory, fields.pop("overlay_text", "logging:\n  level: debug\n")
    )
    states: dict[str, tuple[DeployManifest, bytes]] = {}
    for target, path, model_id, version, artifacts in (
        (CONFIG_TARGET, overlay, "config", "c1", []),
        (
            AGENT_TARGET,
            document,
            "edge-agent",
            "9.9.9",
            [describe_artifact(wheel, name=wheel.name, kind="wheel")],
        ),
    ):
        manifest = build_manifest(
            path,
            job_id=f"bundle-{device}-{target.strip('_')}-{sequence}",
            sequence=sequence,
            slot=target,
            model_id=model_id,
            version=version,
            device=device,
            chunk_size=4 * KIB,
            artifacts=artifacts,
            **fields,
        )
        out = directory / f"{target}.{sequence}.release.json"
        release = sign_release(manifest, [trust.release_key], out, version=1, expires_days=30).read_text()
        key, key_id = trust.controller()
        states[target] = (manifest, sign_manifest(manifest, key, key_id, release=release))
    return states
