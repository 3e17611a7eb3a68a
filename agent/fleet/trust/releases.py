"""A model release signed with the offline release key: the model's bytes, its artifacts and its pre- and
postprocessing bound in one TUF targets document (:mod:`agent.trust.release`) that deployments carry."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

from agent.fleet.trust.keyring import signer
from agent.fsutil import atomic_write_bytes
from agent.protocol.manifest import DeployManifest
from agent.trust.release import release_for


def sign_release(
    manifest: DeployManifest, keys: list[Path], out: Path, *, version: int, expires_days: float
) -> Path:
    """Write the release of ``manifest`` signed with every key file of ``keys`` to ``out``."""
    expires = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(days=expires_days)
    release = release_for(manifest, version=version, expires=expires)
    for key in keys:
        release.sign(signer(key), append=True)
    atomic_write_bytes(out, release.to_bytes(), mode=0o644)
    return out
