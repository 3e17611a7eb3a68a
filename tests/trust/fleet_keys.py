"""A test fleet's root made at run time: root, release and controller keys, none spelled anywhere."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

from securesystemslib.signer import CryptoSigner
from tuf.api.metadata import Metadata, Root

from agent.protocol.manifest import DeployManifest, build_manifest
from agent.trust.roles import CONTROLLER, RELEASE, ROOT, UNUSED


def signer() -> CryptoSigner:
    """A new Ed25519 signer (private key in memory only)."""
    return CryptoSigner.generate_ed25519()


def in_days(days: float) -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0) + timedelta(days=days)


@dataclass
class FleetKeys:
    """The keys of a test fleet and the root versions signed so far."""

    root_keys: list[CryptoSigner] = field(default_factory=lambda: [signer() for _ in range(3)])
    release: CryptoSigner = field(default_factory=signer)
    controller: CryptoSigner = field(default_factory=signer)
    threshold: int = 2

    def root(
        self, version: int = 1, *, expires: datetime | None = None, sign_with: int | None = None
    ) -> Metadata[Root]:
        """Root ``version`` naming the current keys, signed by the first ``sign_with`` root keys."""
        root = Root(version=version, expires=expires or in_days(365))
        for key in self.root_keys:
            root.add_key(key.public_key, ROOT)
        root.add_key(self.release.public_key, RELEASE)
        for role in (CONTROLLER, UNUSED):
            root.add_key(self.controller.public_key, role)
        root.roles[ROOT].threshold = self.threshold
        metadata = Metadata(root)
        for key in self.root_keys[: sign_with if sign_with is not None else len(self.root_keys)]:
            metadata.sign(key, append=True)
        return metadata


def model_manifest(tmp_path: Path, name: str = "model", size: int = 3000) -> DeployManifest:
    """A manifest of ``size`` random bytes (delivery hashes the file; what it holds does not matter here)."""
    path = tmp_path / f"{name}.onnx"
    path.write_bytes(os.urandom(size))
    return build_manifest(path, job_id=f"job-{name}", sequence=1, slot="main", model_id=name, version="1")
