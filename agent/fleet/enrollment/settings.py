"""``enrollment:`` in controller.yaml: where the device CA is, who is admitted at once, and the bounds."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from agent.model_base import StrictModel


class EnrollmentSettings(StrictModel):
    """The controller's enrollment desk (docs/enrollment.md); off unless ``ca_dir`` is set."""

    ca_dir: Path | None = Field(
        None,
        description="The CA directory `edge-agent fleet ca init` made (the devices intermediate, the "
        "claims CA, the claims ledger). Unset: the controller answers no enrollment.",
    )
    registered_file: Path | None = Field(
        None,
        description="YAML list of devices admitted at once, each {id: ..., serial: ...} (either or "
        "both); read at start, beside those `fleet devices register` keeps in the store.",
    )
    certificate_days: int = Field(30, ge=1, le=365, description="Life of a device certificate issued.")
    max_pending: int = Field(
        1000, ge=1, le=100_000, description="Requests waiting for an operator, all claims together."
    )
    max_pending_per_claim: int = Field(
        200, ge=1, le=100_000, description="Requests waiting for an operator made with one claim."
    )
    pending_forget_s: float = Field(
        7 * 86400.0,
        ge=60,
        le=365 * 86400.0,
        description="A waiting device not heard this long leaves the pending list (it asks again to "
        "come back).",
    )
    pending_retry_s: float = Field(
        60.0, ge=1, le=86_400, description="A pending device asks again after at least this long."
    )
    refused_retry_s: float = Field(
        600.0, ge=1, le=86_400, description="A refused device asks again after at least this long."
    )
    rejected_retry_s: float = Field(
        3600.0, ge=1, le=86_400, description="A rejected device asks again after at least this long."
    )
    min_renew_interval_s: float = Field(
        3600.0,
        ge=0,
        le=86_400 * 30,
        description="A device renewing again sooner than this with a new key is refused (too_soon); "
        "the same request or key gets its current certificate again.",
    )
    queue: int = Field(
        1024, ge=1, le=100_000, description="Requests waiting to be read; more are dropped and counted."
    )
    crl_check_s: float = Field(
        3600.0,
        ge=0.1,
        le=86_400,
        description="How often the desk re-issues the CRL once half its life is gone (and tells the "
        "broker): an expired CRL makes the broker refuse every device.",
    )
