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


class TransportError(AgentError):
    """The MQTT link refused an operation (payload too large, queue full, not connected)."""

    code = "transport_error"


class DeliveryError(AgentError):
    """A model delivery (manifest, signature, transfer, verification) failed."""

    code = "delivery_failed"


class BuildError(AgentError):
    """An engine could not be planned or built."""

    code = "build_failed"


class EngineError(AgentError):
    """An engine could not be loaded, validated or run."""

    code = "engine_failed"


class SourceError(AgentError):
    """A camera source could not be opened or read."""

    code = "source_failed"
