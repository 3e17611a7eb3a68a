"""Delivery errors, one class per stable ``code`` (published as ``error_code`` in job status).

``rejects`` decides the job's end state: True means the manifest or model itself is unacceptable
(REJECTED: sending the same thing again cannot work); False means the attempt failed for a reason
that may pass next time (FAILED: free disk space, fix the network, then publish a new manifest).
"""

from __future__ import annotations

# The errors the model store raises too live at the ground floor, so the store need not import
# delivery (which imports the store); they are delivery errors all the same, importable from here.
from agent.errors import DeliveryError, DiskFullError, HashMismatchError, RejectedError

__all__ = [
    "AgentIncompatibleError",
    "AgentInstallFailedError",
    "BadJsonError",
    "BadManifestError",
    "BadNameError",
    "BadOnnxError",
    "BadSignatureError",
    "Cancelled",
    "ConfigInvalidError",
    "DiskFull",
    "DiskFullError",
    "HashMismatch",
    "HashMismatchError",
    "IncompatibleError",
    "JobCancelledError",
    "OnnxCheckerError",
    "RejectedError",
    "ReplayError",
    "RevokedKeyError",
    "RolledBackError",
    "ShadowRejectedError",
    "TooLargeError",
    "TrustExpiredError",
    "UnknownKeyError",
    "UnreleasedError",
    "UnsignedError",
    "WrongDeviceError",
    "WrongSlotError",
    "rejects",
]


class BadJsonError(RejectedError):
    """The payload (or the manifest string inside it) is not JSON."""

    code = "bad_json"


class BadManifestError(RejectedError):
    """Valid JSON of the wrong shape; the message names the field path."""

    code = "bad_manifest"


class BadSignatureError(RejectedError):
    """The Ed25519 signature does not match the manifest bytes (or is not valid base64)."""

    code = "bad_signature"


class UnknownKeyError(RejectedError):
    """The manifest is signed with a key id the device does not trust."""

    code = "unknown_key"


class UnsignedError(RejectedError):
    """No signature although ``delivery.require_signature`` is true."""

    code = "unsigned"


class WrongDeviceError(RejectedError):
    """The manifest's ``device`` field names another device."""

    code = "wrong_device"


class WrongSlotError(RejectedError):
    """The manifest's ``slot`` differs from the slot of the topic it arrived on, or is not configured."""

    code = "wrong_slot"


class BadNameError(RejectedError):
    """A job id, slot, model id or version contains a path separator, ``..`` or is otherwise unusable."""

    code = "bad_name"


class ReplayError(RejectedError):
    """A manifest whose sequence is not newer than the last one accepted for the slot."""

    code = "replay"


class UnreleasedError(RejectedError):
    """The device has a fleet root, and no threshold of its release keys signed this deployment's release.

    No release, too few release signatures, or a release of other bytes or specs than the manifest's.
    """

    code = "unreleased"


class RevokedKeyError(RejectedError):
    """The deployment is signed by a key the device's fleet root has revoked."""

    code = "revoked_key"


class TrustExpiredError(RejectedError):
    """The device's fleet root, or the release, has expired: nothing new is installed until it is renewed."""

    code = "trust_expired"


class TooLargeError(RejectedError):
    """The model is larger than ``delivery.max_model_bytes``."""

    code = "too_large"


class BadOnnxError(RejectedError):
    """The model file cannot be parsed as ONNX (truncated, not a model, external data)."""

    code = "bad_onnx"


class OnnxCheckerError(RejectedError):
    """``onnx.checker.check_model`` refuses the model."""

    code = "onnx_checker"


class IncompatibleError(RejectedError):
    """The model's inputs or outputs do not fit the slot's pre/postprocessing."""

    code = "incompatible"


class ConfigInvalidError(RejectedError):
    """A configuration overlay (target ``_config``) fails the agent.yaml schema, sets a key an overlay
    may not set, or names files the device lacks; nothing was changed."""

    code = "config_invalid"


class AgentIncompatibleError(RejectedError):
    """An agent release (target ``_agent``) is for another Python or machine, or names a wheel whose
    tags this device cannot install; nothing was changed."""

    code = "agent_incompatible"


class AgentInstallFailedError(DeliveryError):
    """Installing an agent release side by side failed (a dependency missing offline, pip failed, disk);
    the running release was not touched and keeps running (job ends FAILED)."""

    code = "agent_install_failed"


class JobCancelledError(DeliveryError):
    """The job was cancelled (superseded by a newer manifest, or the agent is stopping)."""

    code = "cancelled"
    rejects = False


# -- transfer errors (codes published in job status; all end a job FAILED, a new manifest retries) --


class TransferTimeoutError(DeliveryError):
    """The download did not finish within ``delivery.job_deadline_s``."""

    code = "transfer_timeout"
    rejects = False


class HttpNotFoundError(DeliveryError):
    """An HTTP(S) model source answered 404."""

    code = "http_not_found"
    rejects = False


class HttpFailedError(DeliveryError):
    """An HTTP(S) model source failed (connection, status, retries exhausted, wrong bytes)."""

    code = "http_failed"
    rejects = False


class NoSourceError(DeliveryError):
    """The manifest lists no source this agent can use."""

    code = "no_source"
    rejects = False


class ShadowRejectedError(RejectedError):
    """The candidate failed its shadow run (the old model never stopped serving).

    ``code`` is set per instance: ``shadow_disagrees``, ``too_slow``, ``bad_output`` or ``shadow_no_frames``.
    """

    code = "shadow_disagrees"

    def __init__(self, message: str, *, code: str, job_id: str | None = None) -> None:
        super().__init__(message, job_id=job_id)
        self.code = code


class RolledBackError(DeliveryError):
    """The new model served and was swapped back to the last-known-good one (job ends ROLLED_BACK).

    ``code``: ``unhealthy`` (a probation figure crossed its bar), ``operator_rollback``, and for the
    device's own targets ``config_reverted`` (the overlay was put back) or ``agent_reverted`` (the
    previous agent release runs again).
    """

    code = "unhealthy"

    def __init__(self, message: str, *, code: str = "unhealthy") -> None:
        super().__init__(message)
        self.code = code


def rejects(exc: BaseException) -> bool:
    """True when ``exc`` should end a job REJECTED rather than FAILED."""
    return bool(getattr(exc, "rejects", False))


# Short names the transfer modules import (kept so both spellings work).
Cancelled = JobCancelledError
DiskFull = DiskFullError
HashMismatch = HashMismatchError
