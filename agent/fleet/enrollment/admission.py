"""The admission policy, pure: what the desk does with a request whose claim and CSR passed their checks.

In order: an id whose certificate was revoked waits for an operator's ``accept --reenroll``; an id
enrolled with this very key gets its certificate again (a repeated request, never a
second certificate); an id enrolled with another key waits for an operator's ``accept --reenroll``
(a factory reset, or someone else asking for that id); a rejected id stays rejected; an id
registered with a serial is issued only when the request names that serial; a registered id or
serial is issued at once; anything else waits as pending, first key first: a request for a waiting
id with another key is refused (``id_contested``), never put in its place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from agent.fleet.enrollment.book import Enrolled, Pending, Registration

Action = Literal["resend", "issue", "wait", "touch", "rejected", "refuse"]


@dataclass(frozen=True)
class Verdict:
    """What to do: ``action``, and for a wait or a refusal its ``code`` and one-line ``message``."""

    action: Action
    code: str = ""
    message: str = ""


@dataclass(frozen=True)
class Known:
    """What the desk's records say of the id asked for (each None when there is nothing)."""

    enrolled: Enrolled | None
    pending: Pending | None
    rejected: str | None
    by_id: Registration | None
    by_serial: Registration | None
    revoked: bool = False  # the enrolled certificate was revoked (fleet devices revoke, decommission)


def admit(device_id: str, serial: str | None, fingerprint: str, known: Known) -> Verdict:
    """The verdict for a request for ``device_id`` (naming hardware ``serial``) with key ``fingerprint``."""
    if known.enrolled is not None and known.revoked:
        return _needs_reenroll(
            device_id, known, fingerprint, "revoked", f"{device_id}'s certificate was revoked"
        )
    if known.enrolled is not None:
        if known.enrolled.fingerprint == fingerprint:
            return Verdict("resend")
        return _needs_reenroll(
            device_id, known, fingerprint, "already_enrolled", f"{device_id} is enrolled with another key"
        )
    if known.rejected is not None:
        return Verdict("rejected", "rejected", f"{device_id} was rejected by an operator: {known.rejected}")
    if known.by_id is not None and known.by_id.serial is not None and known.by_id.serial != serial:
        return Verdict(
            "refuse",
            "serial_mismatch",
            f"{device_id} is registered with another hardware serial than the request names",
        )
    if known.by_id is not None or known.by_serial is not None:
        return Verdict("issue")
    if known.pending is not None:
        if known.pending.fingerprint != fingerprint:
            return _contested(device_id)
        return Verdict("touch", "pending", _waiting(device_id))
    return Verdict("wait", "pending", _waiting(device_id))


def _needs_reenroll(device_id: str, known: Known, fingerprint: str, code: str, why: str) -> Verdict:
    """An id holding a certificate already waits for ``accept --reenroll`` (first key first)."""
    if known.pending is not None and known.pending.fingerprint != fingerprint:
        return _contested(device_id)
    return Verdict(
        "wait" if known.pending is None else "touch",
        code,
        f"{why}; an operator must run `edge-agent fleet devices accept {device_id} --reenroll`",
    )


def _waiting(device_id: str) -> str:
    return f"{device_id} waits for an operator: `edge-agent fleet devices accept {device_id}`"


def _contested(device_id: str) -> Verdict:
    return Verdict(
        "refuse",
        "id_contested",
        f"another key already waits for {device_id}; an operator decides between them",
    )
