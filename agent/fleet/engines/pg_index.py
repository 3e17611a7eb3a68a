"""The engine store's index in PostgreSQL, for a controller whose store is there (``database.url``).

The same store as :class:`~agent.fleet.engines.store.EngineStore`, with ``index.json`` replaced by
the one row of ``engine_index`` (the whole index, written in one transaction that the lease's token
guards, as every write of a controller on PostgreSQL). What a takeover keeps: the **withdrawn**
engines and their notes, so bytes one controller withdrew are never taken again by the next; the
entries whose blobs this controller has (under ``{state_dir}/engines/blobs``). An entry whose blobs
are on the other host only is left out, as a cache miss: a device asking for it builds it again
(a device is never told of an engine it cannot download).
"""

from __future__ import annotations

import time
from pathlib import Path

import structlog
from pydantic import ValidationError

from agent.fleet.engines.settings import EngineShareSettings
from agent.fleet.engines.store import EngineStore, _Index
from agent.fleet.statedb.postgres import Fence, StateDatabase

log = structlog.get_logger(__name__)


class PostgresEngineStore(EngineStore):
    """Vouched engines by key, the index in ``database`` (read at :meth:`create`, once the lease is held)."""

    def __init__(self, directory: Path, bounds: EngineShareSettings, database: StateDatabase) -> None:
        self.database = database
        #: The lease token every index write checks (set by the controller before :meth:`create`).
        self.fence: Fence | None = None
        self._opened = False
        super().__init__(directory, bounds, create=False)

    def create(self) -> None:
        super().create()
        self.database.migrate()
        with self._lock:
            self._opened = True
            self._index = self._read()

    def _load(self) -> _Index:
        return _Index()  # nothing before the lease: read at create()

    def _read(self) -> _Index:
        with self.database.session() as sql:
            row = sql.execute("SELECT doc FROM engine_index WHERE id = 1").fetchone()
        if row is None:
            return _Index()
        try:
            index = _Index.model_validate_json(row[0])
        except ValidationError as exc:
            # A cache: an unreadable index costs builds, never a controller start.
            log.warning("fleet.engines.index_unreadable", database=self.database.where, error=str(exc)[:300])
            return _Index()
        here = {
            key: entry
            for key, entry in index.engines.items()
            if all(self.blob_path(f.sha256).is_file() for f in entry.record.files)
        }
        if len(here) < len(index.engines):
            log.info("fleet.engines.elsewhere", left_out=len(index.engines) - len(here), kept=len(here))
        return index.model_copy(update={"engines": here})

    def _save(self) -> None:
        if not self._opened:
            return
        doc = self._index.model_dump_json()
        with self.database.transaction(self.fence) as sql:
            sql.execute(
                "INSERT INTO engine_index (id, doc, saved_at) VALUES (1, ?, ?) "
                "ON CONFLICT (id) DO UPDATE SET doc = EXCLUDED.doc, saved_at = EXCLUDED.saved_at",
                (doc, time.time()),
            )
