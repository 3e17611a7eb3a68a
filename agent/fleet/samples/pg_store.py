"""The samples store on PostgreSQL: the file store's bounds, order and interface, the documents kept
as rows of ``samples`` (payload included), so a controller that took the lease over on another host,
with another ``state_dir``, keeps and exports the same samples.

Each add is one transaction: the table locked against other writers (``EXCLUSIVE``: readers go on),
so two controllers adding at once take turns and the bounds hold for both; the message looked up
(kept once, whichever controller took it); this device's oldest deleted down to ``per_device - 1``,
then the oldest of all while the count or the bytes would pass their bound; then the new row. A
controller killed at any point leaves the sample whole or absent and the store within its bounds.
With a :attr:`fence`, the transaction first checks the lease's token, as every write of a
controller on PostgreSQL does.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

from agent.fleet.samples.store import FileSampleStore, SampleBounds, SampleStore, StoredSample, sample_of
from agent.fleet.statedb.postgres import (
    DEAD_LINK_S,
    DatabaseError,
    DatabaseUnavailableError,
    Fence,
    StateDatabase,
)
from agent.protocol.samples import SampleMessage

#: Samples read per query while exporting: memory stays bounded whatever the store holds.
_PAGE = 64

# The oldest rows whose eviction the bounds still need: before row i goes, the rows from i on are
# left; a row goes while they and the new sample would pass max_count or max_bytes (a prefix).
_EVICT_OLDEST = """
WITH ordered AS (
    SELECT seq,
           count(*) OVER () - row_number() OVER (ORDER BY seq) + 1 AS rows_left,
           sum(size) OVER () - sum(size) OVER (ORDER BY seq) + size AS bytes_left
    FROM samples
)
DELETE FROM samples WHERE seq IN (
    SELECT seq FROM ordered WHERE rows_left + 1 > ? OR bytes_left + ? > ?
) RETURNING seq
"""


def open_sample_store(
    directory: Path, bounds: SampleBounds, database: StateDatabase | None, *, fence: Fence | None = None
) -> SampleStore:
    """The controller's samples: in ``database`` when its store is PostgreSQL, else files under
    ``directory``."""
    if database is None:
        return FileSampleStore(directory, bounds)
    return PostgresSampleStore(database, bounds, fence=fence)


class PostgresSampleStore(SampleStore):
    """Samples in the PostgreSQL ``database`` (migrated at open unless ``migrate`` is False: a
    reader's), oldest evicted past the bounds."""

    def __init__(
        self,
        database: StateDatabase,
        bounds: SampleBounds | None = None,
        *,
        fence: Fence | None = None,
        migrate: bool = True,
    ) -> None:
        super().__init__(bounds)
        self.database = database
        #: The lease token every add checks (None: unguarded, as the export reads).
        self.fence = fence
        #: Until then an add is refused at once: the database was just out of reach, and a sample
        #: must not hold the controller's message thread for a connect timeout each.
        self._down_until = 0.0
        try:
            if migrate:
                database.migrate()
            else:
                self._check_tables()
        except DatabaseError:
            database.close()
            raise

    def _check_tables(self) -> None:
        with self.database.session() as sql:
            table = sql.execute("SELECT to_regclass('samples')").fetchone()
        if table is None or table[0] is None:
            raise DatabaseError(
                f"{self.database.where} has no samples table yet: no controller of this version has "
                "opened it (a controller started with this database.url makes its tables)"
            )

    def close(self) -> None:
        self.database.close()

    def _keep(self, device: str, msg_id: str, data: bytes) -> tuple[StoredSample, int] | None:
        if time.monotonic() < self._down_until:
            raise DatabaseUnavailableError(
                f"{self.database.where} was out of reach less than {DEAD_LINK_S} s ago; the sample "
                "was not kept (tried again after that)"
            )
        try:
            with self.database.transaction(self.fence) as sql:
                sql.execute("LOCK TABLE samples IN EXCLUSIVE MODE")
                taken = sql.execute(
                    "SELECT 1 FROM samples WHERE device = ? AND msg_id = ?", (device, msg_id)
                ).fetchone()
                if taken is not None:
                    return None
                mine = sql.execute(
                    "DELETE FROM samples WHERE seq IN (SELECT seq FROM samples WHERE device = ? "
                    "ORDER BY seq DESC OFFSET ?) RETURNING seq",
                    (device, self.bounds.per_device - 1),
                ).fetchall()
                oldest = sql.execute(
                    _EVICT_OLDEST, (self.bounds.max_count, len(data), self.bounds.max_bytes)
                ).fetchall()
                row = sql.execute(
                    "INSERT INTO samples (device, msg_id, size, doc, stored_at) VALUES (?, ?, ?, ?, ?) "
                    "RETURNING seq",
                    (device, msg_id, len(data), data, time.time()),
                ).fetchone()
        except DatabaseUnavailableError:
            self._down_until = time.monotonic() + DEAD_LINK_S
            raise
        return StoredSample(int(row[0]), device, len(data)), len(mine) + len(oldest)

    def read(self, stored: StoredSample) -> SampleMessage:
        with self.database.session() as sql:
            row = sql.execute("SELECT doc FROM samples WHERE seq = ?", (stored.seq,)).fetchone()
        if row is None:
            raise LookupError(f"sample {stored.seq} of {stored.device} was evicted")
        return sample_of(bytes(row[0]))

    def read_all(self) -> Iterator[tuple[StoredSample, SampleMessage]]:
        after = -1
        while True:
            with self.database.session() as sql:
                rows = sql.execute(
                    "SELECT seq, device, size, doc FROM samples WHERE seq > ? ORDER BY seq LIMIT ?",
                    (after, _PAGE),
                ).fetchall()
            for seq, device, size, doc in rows:
                yield StoredSample(int(seq), str(device), int(size)), sample_of(bytes(doc))
            if len(rows) < _PAGE:
                return
            after = int(rows[-1][0])

    def samples(self) -> list[StoredSample]:
        with self.database.session() as sql:
            rows = sql.execute("SELECT seq, device, size FROM samples ORDER BY seq").fetchall()
        return [StoredSample(int(seq), str(device), int(size)) for seq, device, size in rows]

    def held_bytes(self) -> int:
        with self.database.session() as sql:
            row = sql.execute("SELECT COALESCE(SUM(size), 0) FROM samples").fetchone()
        return int(row[0])
