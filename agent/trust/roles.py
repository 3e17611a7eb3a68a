"""The fleet's roles as TUF top-level roles, and the root's list of revoked keys.

TUF's root names exactly four roles. The fleet uses two of them under its own names: the offline
``release`` keys are TUF's ``targets`` role (what may be installed), the controller's online key is
TUF's ``timestamp`` role (it only chooses among releases); ``snapshot`` is given the controller's key
too and is not used.
"""

from __future__ import annotations

from typing import Any

from tuf.api.metadata import Metadata, Root

ROOT = "root"
RELEASE = "targets"
CONTROLLER = "timestamp"
UNUSED = "snapshot"

#: The fleet's name of each role, as the operator types it, and the TUF role it is.
FLEET_ROLES = {"root": ROOT, "release": RELEASE, "controller": CONTROLLER}

#: An extra field of the signed root: key ids revoked for good (a refusal then says ``revoked_key``).
REVOKED_FIELD = "x-edge-revoked"


def revoked_keys(root: Metadata[Root]) -> frozenset[str]:
    """The key ids ``root`` lists as revoked (none when it lists none)."""
    listed: Any = root.signed.unrecognized_fields.get(REVOKED_FIELD, [])
    return frozenset(str(key_id) for key_id in listed) if isinstance(listed, list) else frozenset()


def fleet_role(tuf_role: str) -> str:
    """The operator's name of ``tuf_role`` (``targets`` is ``release``)."""
    for name, role in FLEET_ROLES.items():
        if role == tuf_role:
            return name
    return tuf_role
