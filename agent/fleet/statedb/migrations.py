"""The PostgreSQL schema, as migrations applied in order and recorded in ``schema_migrations``.

Each entry is one version's SQL, applied in one transaction together with its row in
``schema_migrations``; a database that records a version this controller does not know was migrated
by a newer controller and is refused. The tables mirror the SQLite store's (rollout/store.py), with
PostgreSQL's types; ``devices.pos`` keeps the selection order SQLite's ``rowid`` keeps. ``samples``
holds the documents the file store (samples/store.py) writes as files, ``seq`` their order. The
enrollment tables (4) are enrollment/book.py's, column for column, so its queries run on both.
"""

from __future__ import annotations

#: (version, SQL), in the order they are applied; never edit one that was released, add the next.
MIGRATIONS: tuple[tuple[int, str], ...] = (
    (
        1,
        """
CREATE TABLE rollouts (
    id         TEXT PRIMARY KEY,
    slot       TEXT NOT NULL,
    job_id     TEXT NOT NULL,
    to_version TEXT NOT NULL,
    state      TEXT NOT NULL,
    spec       TEXT NOT NULL,
    supersedes TEXT,
    reason     TEXT NOT NULL DEFAULT '',
    created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL
);
CREATE TABLE waves (
    rollout_id TEXT NOT NULL REFERENCES rollouts(id),
    idx        INTEGER NOT NULL,
    state      TEXT NOT NULL,
    figures    TEXT,
    reason     TEXT NOT NULL DEFAULT '',
    started_at DOUBLE PRECISION,
    ended_at   DOUBLE PRECISION,
    PRIMARY KEY (rollout_id, idx)
);
CREATE TABLE devices (
    pos          BIGINT GENERATED ALWAYS AS IDENTITY,
    rollout_id   TEXT NOT NULL REFERENCES rollouts(id),
    device       TEXT NOT NULL,
    wave         INTEGER NOT NULL,
    from_version TEXT,
    to_version   TEXT NOT NULL,
    job_id       TEXT NOT NULL,
    step         TEXT NOT NULL,
    end_state    TEXT,
    figures      TEXT,
    sends        INTEGER NOT NULL DEFAULT 0,
    sent_at      DOUBLE PRECISION,
    ended_at     DOUBLE PRECISION,
    updated_at   DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (rollout_id, device)
);
CREATE INDEX devices_by_device ON devices (device, step);
CREATE INDEX devices_by_wave ON devices (rollout_id, wave, pos);
CREATE TABLE events (
    id         BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    rollout_id TEXT NOT NULL,
    at         DOUBLE PRECISION NOT NULL,
    what       TEXT NOT NULL,
    detail     TEXT NOT NULL
);
CREATE INDEX events_by_rollout ON events (rollout_id, id);
CREATE TABLE controller_lease (
    prefix     TEXT PRIMARY KEY,
    token      BIGINT NOT NULL,
    holder     TEXT NOT NULL,
    host       TEXT NOT NULL,
    pid        INTEGER NOT NULL,
    state_dir  TEXT NOT NULL,
    since      DOUBLE PRECISION NOT NULL,
    ttl_s      INTEGER NOT NULL,
    expires_at TIMESTAMPTZ NOT NULL
);
CREATE TABLE models (
    sha256    TEXT PRIMARY KEY,
    size      BIGINT NOT NULL,
    stored_at DOUBLE PRECISION NOT NULL
);
CREATE TABLE model_chunks (
    sha256 TEXT NOT NULL,
    idx    INTEGER NOT NULL,
    data   BYTEA NOT NULL,
    PRIMARY KEY (sha256, idx)
);
""",
    ),
    (
        2,
        """
CREATE TABLE engine_index (
    id       INTEGER PRIMARY KEY CHECK (id = 1),
    doc      TEXT NOT NULL,
    saved_at DOUBLE PRECISION NOT NULL
);
""",
    ),
    (
        3,
        """
CREATE TABLE samples (
    seq       BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    device    TEXT NOT NULL,
    msg_id    TEXT NOT NULL,
    size      INTEGER NOT NULL,
    doc       BYTEA NOT NULL,
    stored_at DOUBLE PRECISION NOT NULL,
    UNIQUE (device, msg_id)
);
CREATE INDEX samples_by_device ON samples (device, seq);
""",
    ),
    (
        4,
        """
CREATE TABLE registered (
    kind   TEXT NOT NULL,
    value  TEXT NOT NULL,
    serial TEXT,
    source TEXT NOT NULL,
    at     DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (kind, value)
);
CREATE TABLE pending (
    device_id   TEXT PRIMARY KEY,
    claim       TEXT NOT NULL,
    serial      TEXT,
    fingerprint TEXT NOT NULL,
    csr_pem     TEXT NOT NULL,
    request_id  TEXT NOT NULL,
    code        TEXT NOT NULL,
    first_at    DOUBLE PRECISION NOT NULL,
    last_at     DOUBLE PRECISION NOT NULL,
    asks        INTEGER NOT NULL,
    contested   INTEGER NOT NULL,
    client      TEXT NOT NULL
);
CREATE INDEX pending_claim ON pending (claim);
CREATE TABLE rejected (
    device_id TEXT PRIMARY KEY,
    reason    TEXT NOT NULL,
    at        DOUBLE PRECISION NOT NULL
);
CREATE TABLE enrolled (
    device_id  TEXT PRIMARY KEY,
    fingerprint TEXT NOT NULL,
    serial     TEXT NOT NULL,
    not_after  DOUBLE PRECISION NOT NULL,
    issued_at  DOUBLE PRECISION NOT NULL,
    claim      TEXT,
    hw_serial  TEXT,
    request_id TEXT NOT NULL,
    cert_pem   TEXT NOT NULL,
    chain_pem  TEXT NOT NULL
);
CREATE TABLE claim_uses (
    claim TEXT PRIMARY KEY,
    uses  INTEGER NOT NULL
);
""",
    ),
)

#: The newest version this controller knows.
LATEST = MIGRATIONS[-1][0]
