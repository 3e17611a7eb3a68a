"""The operator side's fixtures: its stores on SQLite and on a real PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fleet.store_sites import StoreSite
from tests.postgres_server import PostgresServer


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """This worker's PostgreSQL server (started once, stopped at the end of the session)."""
    server = PostgresServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_site(request: pytest.FixtureRequest, tmp_path: Path) -> StoreSite:
    """A new, empty store: a SQLite file, or a fresh database on this worker's PostgreSQL."""
    if request.param == "sqlite":
        return StoreSite("sqlite", str(tmp_path / "rollouts.sqlite"))
    server: PostgresServer = request.getfixturevalue("postgres")
    return StoreSite("postgresql", server.conninfo(server.new_database()))
