"""The ``enrollment:`` section: where the claim is, where to ask with it, and when to renew.

At the ground floor (docs/architecture.md): a settings model with no behaviour. The device's own
key and certificate are ``mqtt.tls.key_file`` and ``mqtt.tls.cert_file``; enrollment writes them,
renewal replaces the certificate, and the agent connects with them as with any other.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from agent.model_base import StrictModel


class RenewalSettings(StrictModel):
    """Renewal of the device's certificate over its own connection (``up/cert`` -> ``down/cert``)."""

    enabled: bool = Field(True, description="Renew the certificate before it expires.")
    at_fraction: float = Field(
        2 / 3,
        gt=0.0,
        lt=1.0,
        description="Ask for a new certificate once this fraction of the current one's life has passed.",
    )
    reply_timeout_s: float = Field(
        60.0, gt=0, le=3600, description="A request unanswered this long is asked again (with backoff)."
    )
    retry_min_s: float = Field(30.0, gt=0, description="First wait after a refused or unanswered request.")
    retry_max_s: float = Field(3600.0, gt=0, description="Longest wait between renewal requests.")

    @model_validator(mode="after")
    def _retry_window(self) -> RenewalSettings:
        if self.retry_max_s < self.retry_min_s:
            raise ValueError("retry_max_s must be at least retry_min_s")
        return self


class EnrollmentSettings(StrictModel):
    """Enrollment by claim: present in agent.yaml, the first start asks for a certificate of its own
    when ``mqtt.tls.cert_file`` is missing (``edge-agent enroll`` does the same by hand)."""

    host: str | None = Field(
        None, description="The broker's enrollment listener; default: mqtt.host (the same broker)."
    )
    port: int = Field(8885, gt=0, lt=65536, description="The enrollment listener's port (TLS).")
    claim_cert_file: Path = Field(description="The claim certificate (PEM), shared by a batch of devices.")
    claim_key_file: Path = Field(description="The claim's private key (PEM); only signs requests.")
    serial: str | None = Field(
        None,
        max_length=128,
        description="A hardware serial the operator may have registered this device by.",
    )
    reply_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="A request unanswered this long is asked again (with backoff)."
    )
    retry_min_s: float = Field(
        5.0, gt=0, description="First wait after pending, rejected, refused or no answer (or retry_after_s)."
    )
    retry_max_s: float = Field(900.0, gt=0, description="Longest wait between enrollment requests.")
    renewal: RenewalSettings = Field(default_factory=RenewalSettings)

    @model_validator(mode="after")
    def _retry_window(self) -> EnrollmentSettings:
        if self.retry_max_s < self.retry_min_s:
            raise ValueError("retry_max_s must be at least retry_min_s")
        return self
