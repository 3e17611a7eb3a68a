"""The ``delivery:`` section of the configuration."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from agent.model_base import StrictModel


class DeliveryConfig(StrictModel):
    """How the agent accepts models over MQTT."""

    enabled: bool = Field(
        True, description="Subscribe to down/desired/+ (commands on down/cmd/+ are served either way)."
    )
    require_signature: bool = Field(True, description="Refuse manifests without a valid Ed25519 signature.")
    trusted_keys: dict[str, Path] = Field(
        default_factory=dict, description="key_id -> Ed25519 public key file (PEM or raw 32-byte base64)."
    )
    trust_root: Path | None = Field(
        None,
        description="The fleet root (TUF root metadata, `edge-agent fleet trust init`): desired states must "
        "then name a release signed by its release keys and be signed by its controller key; "
        "trusted_keys is not used. Newer root versions arrive over MQTT (docs/trust.md).",
    )
    max_model_bytes: int = Field(512 * 1024 * 1024, gt=0, description="Largest model accepted.")
    disk_headroom_bytes: int = Field(
        256 * 1024 * 1024,
        ge=0,
        description="Free disk required beyond the model size (engine builds, GC slack).",
    )
    keep_models: int = Field(2, ge=0, description="Models kept besides the active and last-known-good ones.")
    chunk_window: int = Field(32, ge=1, le=256, description="Chunk requests outstanding at once.")
    chunk_timeout_s: float = Field(
        5.0, gt=0, description="A chunk not answered in this time is re-requested."
    )
    job_deadline_s: float = Field(
        600.0, gt=0, description="A download not finished in this time fails the job."
    )
    http_timeout_s: float = Field(30.0, gt=0, description="Connect/read timeout of HTTP(S) model sources.")
    disk_full_retry_s: float = Field(
        30.0,
        gt=0,
        description="How often a job that failed disk_full is retried by the device itself, once the "
        "free space it needs is back and the link is up.",
    )
