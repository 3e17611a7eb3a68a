"""The agent's error hierarchy: every failure an operator can see is one of these.

Messages say what was wrong and what to do about it; library exceptions are converted at the
boundary with ``raise ... from``.
"""

from __future__ import annotations


class AgentError(Exception):
    """Base of every error the agent raises on purpose."""

    #: Stable machine-readable code, published in job status and command replies.
    code = "agent_error"


class ConfigError(AgentError):
    """The configuration file or environment is invalid.

    ``problems`` lists every error as ``key.path: what is wrong``, so ``check-config`` can print them all.
    """

    code = "config_invalid"

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or [message]


class UsageError(ConfigError):
    """A command-line flag or argument is wrong; the message names the flag (``--args: not valid JSON``).

    A ConfigError, so code that handles bad settings handles it too; the CLI prints it as a plain
    ``error:``, not a ``config error:``, since no configuration file is involved.
    """

    code = "usage_error"


class TransportError(AgentError):
    """The MQTT link refused an operation (payload too large, queue full, not connected)."""

    code = "transport_error"


class DeliveryError(AgentError):
    """A model delivery (manifest, signature, transfer, verification) failed."""

    code = "delivery_failed"


# --- delivery errors the model store raises too (agent.protocol.delivery_errors holds the rest) -----------


class RejectedError(DeliveryError):
    """Base of the errors that end a job REJECTED."""

    code = "rejected"
    rejects = True

    def __init__(self, message: str, *, job_id: str | None = None) -> None:
        super().__init__(message)
        #: Job id the refused manifest named, when it could be read (to publish REJECTED on it).
        self.job_id = job_id


class HashMismatchError(RejectedError):
    """The assembled file's SHA-256 differs from the manifest's.

    Every chunk matched its own hash, so the manifest itself is inconsistent.
    """

    code = "hash_mismatch"


class DiskFullError(DeliveryError):
    """Not enough free disk space for the model plus the configured headroom."""

    code = "disk_full"
    rejects = False


class BuildError(AgentError):
    """An engine could not be planned or built."""

    code = "build_failed"


class EngineError(AgentError):
    """An engine could not be loaded, validated or run."""

    code = "engine_failed"


class SourceError(AgentError):
    """A camera source could not be opened or read."""

    code = "source_failed"


class CredentialsRejectedError(SourceError):
    """The camera refused the credentials: retrying soon only counts towards the camera's lockout."""
