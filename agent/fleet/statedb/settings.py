"""``database:`` in controller.yaml: PostgreSQL instead of the SQLite files under ``state_dir``."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from agent.model_base import StrictModel


class DatabaseSettings(StrictModel):
    """The controller's store: SQLite under ``state_dir`` (no ``url``), or the PostgreSQL at ``url``."""

    url: str | None = Field(
        None,
        description="PostgreSQL connection URL without a password "
        "(postgresql://fleet@db.example:5432/fleet); none: SQLite files under state_dir.",
    )
    password_file: Path | None = Field(
        None, description="File holding the database user's password (chmod 600); none: no password."
    )
    connect_timeout_s: int = Field(5, ge=1, le=300, description="Longest wait to connect to the database.")

    @field_validator("url")
    @classmethod
    def _no_password_in_url(cls, url: str | None) -> str | None:
        if url is None:
            return url
        if not url.startswith(("postgresql://", "postgres://")):
            raise ValueError("give a postgresql:// URL (postgresql://user@host:5432/dbname)")
        credentials = url.split("://", 1)[1].split("@", 1)[0] if "@" in url else ""
        if ":" in credentials or "password=" in url:
            raise ValueError("the URL carries a password: put it in password_file instead")
        return url
