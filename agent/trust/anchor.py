"""The device's fleet root on disk: the configured anchor, and the newer versions taken over MQTT.

The configured file is where trust starts (like TUF's first root.json); every version taken since is
kept under the state directory (temp + fsync + rename), so a restart neither forgets a rotation nor
trusts a revoked key again. A chain message that is not taken costs nothing: the current root stays.
"""

from __future__ import annotations

import base64
import binascii
import json
import threading
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path

import structlog
from pydantic import ValidationError
from tuf.api.metadata import Metadata, Root

from agent.errors import ConfigError
from agent.fsutil import atomic_write_bytes
from agent.protocol.messages import MAX_ROOT_CHAIN_BYTES, RootChain
from agent.signing import Ed25519PublicKey, verify
from agent.trust.root import RootRefusedError, check_self_signed, newest_root, read_root

log = structlog.get_logger(__name__)


def _load(path: Path, what: str) -> Metadata[Root]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read it ({exc.strerror or exc})") from exc
    try:
        root = read_root(data, f"{what} {path}")
        check_self_signed(root, f"{what} {path}")
    except RootRefusedError as exc:
        raise ConfigError(str(exc)) from exc
    return root


def adopted_root(payload: bytes, trusted: Mapping[str, Ed25519PublicKey], kept: Path) -> FleetRoot | None:
    """A device without a root, given a chain whose first version one of its ``trusted`` keys signed:
    that root, kept at ``kept`` (then newer versions taken as usual); None when the chain does not
    qualify (no adoption signature, an unknown key, a bad signature, an unusable root)."""
    try:
        chain = RootChain.model_validate_json(payload)
        first = read_root(json.dumps(chain.roots[0]).encode("utf-8"), "root chain item 0")
        check_self_signed(first)
    except (ValidationError, RootRefusedError):
        return None
    key = trusted.get(chain.adopt_key_id or "")
    if key is None or chain.adopt_signature is None:
        return None
    try:
        raw = base64.b64decode(chain.adopt_signature, validate=True)
    except (binascii.Error, ValueError):
        return None
    if not verify(key, first.signed_bytes, raw):
        log.error("trust.root.adoption_refused", key_id=chain.adopt_key_id, reason="bad signature")
        return None
    kept.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(kept, first.to_bytes())
    root = FleetRoot(kept, kept)
    root.take(payload)
    log.info("trust.root.adopted", key_id=chain.adopt_key_id, version=root.current().signed.version)
    return root


class FleetRoot:
    """The root this device trusts now; thread-safe (the MQTT dispatcher updates, job threads read)."""

    def __init__(self, anchor: Path, kept: Path) -> None:
        """``anchor``: the configured root file (delivery.trust_root); ``kept``: where taken versions live."""
        self.kept = kept
        root = _load(anchor, "delivery.trust_root")
        if kept.exists():
            try:
                taken = _load(kept, "kept fleet root")
            except ConfigError as exc:
                log.error("trust.root.kept_unreadable", error=str(exc), using="delivery.trust_root")
            else:
                # The configured anchor may be newer (the operator replaced it): the newer one wins.
                root = taken if taken.signed.version > root.signed.version else root
        self._root = root
        self._lock = threading.Lock()

    def current(self) -> Metadata[Root]:
        """The root in force."""
        with self._lock:
            return self._root

    def expired(self, now: datetime | None = None) -> bool:
        """True once the root in force has expired."""
        return self.current().signed.is_expired(now or datetime.now(timezone.utc))

    def stats(self, now: datetime | None = None) -> dict[str, float]:
        """For telemetry (``trust.*``): the root's version, whether it expired, seconds until it does."""
        root = self.current().signed
        left = (root.expires - (now or datetime.now(timezone.utc))).total_seconds()
        return {
            "root_version": float(root.version),
            "root_expired": float(left <= 0),
            "root_expires_in_s": left,
        }

    def take(self, payload: bytes) -> list[RootRefusedError]:
        """Take the newest version of a :class:`RootChain` payload that the rules allow; kept on disk.

        Returns why versions were refused (empty when everything offered was taken or already held).
        """
        try:
            chain = self.read_chain(payload)
        except RootRefusedError as bad:
            log.error("trust.root.refused", code=bad.code, error=str(bad))
            return [bad]
        with self._lock:
            before = self._root
            root, refused = newest_root(before, chain)
            if root is not before:
                self.kept.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(self.kept, root.to_bytes())
                self._root = root
        if root is not before:
            log.info("trust.root.taken", version=root.signed.version, previous=before.signed.version)
        for exc in refused:
            log.error("trust.root.refused", code=exc.code, error=str(exc), kept=root.signed.version)
        return refused

    @staticmethod
    def read_chain(payload: bytes) -> list[Metadata[Root]]:
        """The root versions of a :class:`RootChain` payload, bounded; RootRefusedError when unusable."""
        if len(payload) > MAX_ROOT_CHAIN_BYTES:
            raise RootRefusedError(f"root chain is larger than {MAX_ROOT_CHAIN_BYTES} bytes", code="bad_root")
        try:
            chain = RootChain.model_validate_json(payload)
        except ValidationError as exc:
            problem = exc.errors()[0]["msg"]
            raise RootRefusedError(f"root chain: wrong shape ({problem})", code="bad_root") from exc
        return [
            read_root(json.dumps(item).encode("utf-8"), f"root chain item {i}")
            for i, item in enumerate(chain.roots)
        ]
