"""The ``spool:`` section of the configuration: how much the on-disk outbox may hold, and for how long."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from agent.model_base import StrictModel

#: Results older than this are not worth publishing after an outage (a week: a long weekend and then some).
DEFAULT_RESULTS_TTL_S = 7 * 24 * 3600.0


class SpoolSettings(StrictModel):
    """Caps and policies of the SQLite spool (durable results and job states waiting for the broker)."""

    max_bytes: int = Field(
        1024 * 1024 * 1024,
        ge=1024 * 1024,
        description="Most bytes of messages (payload + topic + per-row overhead) the spool holds; the "
        "file on disk stays within about 1.5x this (SQLite page slack) plus the write-ahead log. "
        "1 GiB: about 1.6 million results of 600 bytes, a small share of a 32 GB eMMC.",
    )
    max_rows: int = Field(
        1_000_000, ge=100, description="Most messages the spool holds (whichever cap is reached first)."
    )
    results_at_cap: Literal["drop_oldest", "drop_newest"] = Field(
        "drop_oldest",
        description="What goes when the spool is full: drop_oldest deletes the oldest durable results to "
        "make room (the freshest data survives), drop_newest refuses new results (the start of the "
        "outage survives). Job states are never dropped; they may exceed the cap.",
    )
    results_ttl_s: float | None = Field(
        DEFAULT_RESULTS_TTL_S,
        gt=0,
        description="Durable results older than this are deleted instead of published after an outage, "
        "and each carries the remaining time as its MQTT 5 Message Expiry Interval. null: never expire.",
    )
