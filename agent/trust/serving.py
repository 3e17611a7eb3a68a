"""Which release keys vouched for the model bytes a device took, so a model serving under a key the
root revoked later is flagged (``release_revoked`` in ``up/info``) while it keeps serving.

Kept by model SHA-256 in ``{state_dir}/trust/releases.json`` (temp + fsync + rename), bounded to the
newest :data:`MAX_KEPT` models: a restart still knows what vouched for the model it serves. A later
release of the same bytes, checked and taken, replaces the keys: re-releasing clears the flag.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import structlog
from tuf.api.metadata import Metadata, Root, Targets

from agent.fsutil import atomic_write_json
from agent.trust.roles import revoked_keys

log = structlog.get_logger(__name__)

#: Models whose release keys are kept: a slot's active and last-known-good models, several slots.
MAX_KEPT = 32
#: Key ids kept per model (a release threshold is a handful of keys).
MAX_KEYS = 8


class ServingReleases:
    """The release keys of each model taken under a fleet root, by model SHA-256."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._keys: dict[str, list[str]] = self._read()

    def _read(self) -> dict[str, list[str]]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            # Only a flag is lost: the next release taken writes the file again.
            log.warning("trust.releases.unreadable", path=str(self.path), error=str(exc))
            return {}
        if not isinstance(data, dict):
            return {}
        return {
            str(sha): [str(k) for k in keys][:MAX_KEYS]
            for sha, keys in list(data.items())[-MAX_KEPT:]
            if isinstance(keys, list)
        }

    def note(self, sha256: str, release: Metadata[Targets]) -> None:
        """Remember that ``release``'s signers vouched for the model ``sha256`` (it was checked)."""
        keys = sorted(release.signatures)[:MAX_KEYS]
        with self._lock:
            self._keys.pop(sha256, None)
            self._keys[sha256] = keys
            while len(self._keys) > MAX_KEPT:
                del self._keys[next(iter(self._keys))]
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_json(self.path, self._keys)
            except OSError as exc:
                # The deployment goes on (a full disk): the flag is known until a restart.
                log.warning("trust.releases.unwritten", path=str(self.path), error=str(exc))

    def revoked(self, root: Metadata[Root], sha256: str | None) -> str | None:
        """Why the model ``sha256`` serves under a key ``root`` revoked, or None (not revoked, or not
        taken with a release: a configured model)."""
        with self._lock:
            keys = self._keys.get(sha256 or "", [])
        gone = sorted(revoked_keys(root).intersection(keys))
        if not gone:
            return None
        return (
            f"released under key {', '.join(k[:16] for k in gone)}, revoked by fleet root version "
            f"{root.signed.version}; it keeps serving: re-release it with a current release key and deploy"
        )
