"""The fleet root: read it, check it is fresh, and take a newer version only by TUF's rule.

A new version N+1 is taken only when a threshold of version N's root keys AND a threshold of its own
root keys signed it, so a stolen root key alone cannot replace the root, and a rotation or revocation
travels over the air. Versions are taken one at a time in order; an older or equal version (a replay)
is refused, as is a gap. Pure functions: the caller keeps the file and the clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from tuf.api.exceptions import UnsignedMetadataError
from tuf.api.metadata import Metadata, Root

from agent.trust.roles import ROOT

#: Most root versions one chain message may carry (each a few kilobytes).
MAX_CHAIN = 64


class RootRefusedError(ValueError):
    """A root version that is not taken; ``code`` says why (``bad_root``, ``replayed``, ``gap``,
    ``unsigned_by_old``, ``unsigned_by_new``)."""

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message)
        self.code = code


def read_root(data: bytes, what: str = "root") -> Metadata[Root]:
    """Parse root metadata; RootRefusedError ``bad_root`` saying what is wrong."""
    try:
        metadata = Metadata[Root].from_bytes(data)
    except Exception as exc:  # tuf raises DeserializationError with several causes
        raise RootRefusedError(f"{what}: not TUF root metadata ({exc})", code="bad_root") from exc
    if not isinstance(metadata.signed, Root):
        raise RootRefusedError(f"{what}: is {metadata.signed.type} metadata, not root", code="bad_root")
    return metadata


def check_self_signed(root: Metadata[Root], what: str = "root") -> None:
    """Raise ``unsigned_by_new`` unless a threshold of ``root``'s own root keys signed it."""
    try:
        root.signed.verify_delegate(ROOT, root.signed_bytes, root.signatures)
    except UnsignedMetadataError as exc:
        raise RootRefusedError(
            f"{what} version {root.signed.version}: not signed by a threshold of its own root keys ({exc}); "
            "sign it with more root keys (`edge-agent fleet trust sign`)",
            code="unsigned_by_new",
        ) from exc


def next_root(current: Metadata[Root], candidate: Metadata[Root]) -> Metadata[Root]:
    """``candidate`` if it may replace ``current`` (version N+1, both thresholds), else RootRefusedError."""
    have, got = current.signed.version, candidate.signed.version
    if got <= have:
        raise RootRefusedError(
            f"root version {got} is not newer than the version {have} this device has (a replay)",
            code="replayed",
        )
    if got != have + 1:
        raise RootRefusedError(
            f"root version {got} skips version {have + 1}; publish every version in order",
            code="gap",
        )
    try:
        current.signed.verify_delegate(ROOT, candidate.signed_bytes, candidate.signatures)
    except UnsignedMetadataError as exc:
        raise RootRefusedError(
            f"root version {got}: not signed by a threshold of version {have}'s root keys ({exc})",
            code="unsigned_by_old",
        ) from exc
    check_self_signed(candidate)
    return candidate


def newest_root(
    current: Metadata[Root], chain: Sequence[Metadata[Root]]
) -> tuple[Metadata[Root], list[RootRefusedError]]:
    """Walk ``chain`` from ``current``: versions not newer are skipped, each next one must pass
    :func:`next_root`. The newest root reached, and why the walk stopped early (empty when it did not)."""
    root = current
    newest = max((m.signed.version for m in chain), default=root.signed.version)
    if newest < root.signed.version:
        return root, [
            RootRefusedError(
                f"the newest root offered is version {newest}, older than the version "
                f"{root.signed.version} this device has (a replay, or a withheld newer root)",
                code="replayed",
            )
        ]
    for candidate in sorted(chain, key=lambda m: m.signed.version):
        if candidate.signed.version <= root.signed.version:
            continue
        try:
            root = next_root(root, candidate)
        except RootRefusedError as exc:
            return root, [exc]
    return root, []


def is_expired(root: Metadata[Root], now: datetime) -> bool:
    """True once ``root``'s expiry has passed at ``now`` (an aware datetime)."""
    return root.signed.is_expired(now)
