"""``engines:`` in controller.yaml: whether devices share engines through the controller, and its bounds."""

from __future__ import annotations

from pydantic import Field

from agent.model_base import StrictModel


class EngineShareSettings(StrictModel):
    """The controller's engine store (docs/engines.md, "Engines for the whole fleet")."""

    share: bool = Field(
        True,
        description="Rollouts let devices take engines from the controller and offer theirs (a rollout's "
        "--share-engines/--no-share-engines overrides it). Needs a signing key: unsigned controllers "
        "never share.",
    )
    max_entries: int = Field(200, ge=1, le=100_000, description="Engines kept; least recently used go first.")
    max_bytes: int = Field(
        20 * 1024**3, ge=1024**2, description="Bytes of engines kept; least recently used go first."
    )
    max_engine_bytes: int = Field(
        2 * 1024**3, ge=1024, description="Largest engine entry (all its files) a device may upload."
    )
    max_uploads: int = Field(16, ge=1, le=1024, description="Uploads in progress at once (one per device).")
    claim_quiet_s: float = Field(
        120.0,
        gt=0,
        le=86_400,
        description="A build claim ends when its builder was not heard (an ask, a renewal) for this long: "
        "the next device asking for that key builds it. Builders renew every third of it.",
    )
    max_claims: int = Field(
        1000, ge=1, le=100_000, description="Build claims at once; more askers build without one."
    )
    claim_retry_s: float = Field(
        5.0,
        gt=0,
        le=60,
        description="How long a device told 'being built by D' waits before it asks again (longer with "
        "more waiters: about 50 asks a second per key).",
    )
    queue: int = Field(
        2048,
        ge=1,
        le=100_000,
        description="Requests waiting; more are dropped (the device asks again). Room for a whole fleet "
        "asking at once after an upgrade: an ask is a few hundred bytes, and pieces come from at most "
        "max_uploads uploads, one at a time each.",
    )
