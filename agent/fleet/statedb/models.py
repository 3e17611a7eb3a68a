"""The model repository in the database: every uploaded model's bytes, for whichever controller
holds the lease.

A controller on PostgreSQL keeps its ``models/`` directory as before (the chunk server serves devices
from it), and copies each model it takes into the ``models`` and ``model_chunks`` tables; a controller
that took the lease over, on another host, fetches a model it lacks from there when a rollout needs it
(:meth:`ModelVault.fetch`): its bytes checked against the SHA-256 they are stored under, then written
temp + fsync + rename. In chunks of :data:`CHUNK_BYTES`, so neither side holds a whole model in memory
and no value nears PostgreSQL's 1 GB limit; the ``models`` row is written last, once every chunk is
committed, so a model is there whole or not at all.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import structlog

from agent.fleet.statedb.postgres import DatabaseError, Fence, StateDatabase
from agent.fsutil import fsync_directory

log = structlog.get_logger(__name__)

#: Bytes per stored chunk.
CHUNK_BYTES = 4 * 1024 * 1024


class ModelVault:
    """Models by SHA-256 in ``database`` (its own connection); writes guarded by ``fence``."""

    def __init__(self, database: StateDatabase, *, fence: Fence | None = None) -> None:
        self.database = database
        self.fence = fence

    def has(self, sha256: str) -> bool:
        with self.database.session() as sql:
            return sql.execute("SELECT 1 FROM models WHERE sha256 = ?", (sha256,)).fetchone() is not None

    def put(self, sha256: str, path: Path) -> bool:
        """Store the model file at ``path`` (already checked to hash to ``sha256``); False when it was
        stored already."""
        if self.has(sha256):
            return False
        size = path.stat().st_size
        # The bytes first, in a transaction of their own: content-addressed chunks are the same
        # whoever writes them, and the lease row is not held while a large model streams in (its
        # renewal would wait for it).
        with self.database.transaction() as sql, path.open("rb") as source:
            sql.execute("DELETE FROM model_chunks WHERE sha256 = ?", (sha256,))
            index = 0
            while chunk := source.read(CHUNK_BYTES):
                sql.execute(
                    "INSERT INTO model_chunks (sha256, idx, data) VALUES (?, ?, ?)", (sha256, index, chunk)
                )
                index += 1
        # Then the row that makes the model exist, guarded by the lease like every other write.
        with self.database.transaction(self.fence) as sql:
            added = sql.execute(
                "INSERT INTO models (sha256, size, stored_at) VALUES (?, ?, ?) "
                "ON CONFLICT (sha256) DO NOTHING RETURNING sha256",
                (sha256, size, time.time()),
            ).fetchone()
        if added is None:
            return False
        log.info("fleet.statedb.model_stored", sha256=sha256, bytes=size)
        return True

    def fetch(self, sha256: str, path: Path) -> bool:
        """Write the stored model ``sha256`` to ``path`` (temp + fsync + rename); False when the database
        has none. DatabaseError when the stored bytes do not hash to ``sha256`` (nothing is written)."""
        part = path.with_name(f".vault-{sha256}.part")
        digest = hashlib.sha256()
        with self.database.session() as sql:
            if sql.execute("SELECT 1 FROM models WHERE sha256 = ?", (sha256,)).fetchone() is None:
                return False
            count = int(
                sql.execute("SELECT COUNT(*) FROM model_chunks WHERE sha256 = ?", (sha256,)).fetchone()[0]
            )
            path.parent.mkdir(parents=True, exist_ok=True)
            with part.open("wb") as out:
                for index in range(count):
                    row = sql.execute(
                        "SELECT data FROM model_chunks WHERE sha256 = ? AND idx = ?", (sha256, index)
                    ).fetchone()
                    data = bytes(row[0])
                    digest.update(data)
                    out.write(data)
                out.flush()
                os.fsync(out.fileno())
        if digest.hexdigest() != sha256:
            part.unlink(missing_ok=True)
            raise DatabaseError(
                f"model {sha256[:12]} in {self.database.where} hashes to {digest.hexdigest()[:12]}: "
                "the stored copy is damaged; upload the model again (fleet rollout start uploads it)"
            )
        os.replace(part, path)
        fsync_directory(path.parent)
        log.info("fleet.statedb.model_fetched", sha256=sha256, path=str(path))
        return True
