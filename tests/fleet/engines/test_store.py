"""The controller's engine store: bounded in count and bytes, least recently used first, withdrawals
remembered (bounded), blobs nobody refers to collected, an index that survives a restart."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from agent.fleet.engines.pg_index import PostgresEngineStore
from agent.fleet.engines.settings import EngineShareSettings
from agent.fleet.engines.store import INDEX_FILE, MAX_WITHDRAWN, EngineStore
from agent.fleet.engines.trust import sign_record
from agent.fleet.statedb.postgres import StateDatabase
from agent.signing import Ed25519PrivateKey
from tests.fleet.engines.records import offer, put_blob, record_of
from tests.postgres_server import PostgresServer

MIB = 1024**2

OpenStore = Callable[[EngineShareSettings], EngineStore]


@pytest.fixture(params=["file", "postgresql"])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> OpenStore:
    """The store with its index in ``index.json``, or in a fresh database of the tests' PostgreSQL."""
    if request.param == "file":
        return lambda bounds: EngineStore(tmp_path, bounds)
    server: PostgresServer = request.getfixturevalue("postgres")
    address = server.conninfo(server.new_database())

    def opened(bounds: EngineShareSettings) -> EngineStore:
        store = PostgresEngineStore(tmp_path, bounds, StateDatabase(address))
        store.create()
        return store

    return opened


def add(store: EngineStore, n: int, size: int = 16) -> str:
    key = f"{n:064x}"
    data = bytes([n % 256]) * size
    put_blob(store.blobs, data)
    record = record_of(offer(key=key, data=data))
    store.add(sign_record(record, Ed25519PrivateKey.generate(), "ops"), record)
    return key


def test_the_least_recently_used_engine_goes_first_when_the_count_bound_is_reached(
    open_store: OpenStore,
) -> None:
    store = open_store(EngineShareSettings(max_entries=2))
    first, second = add(store, 1), add(store, 2)
    store.used(first, "dev-b")  # downloaded: now the most recently used
    third = add(store, 3)
    assert {e.record.key for e in store.entries()} == {first, third}
    assert second not in {p.name.removesuffix(".onnx") for p in store.blobs.iterdir()}  # its blob collected


def test_engines_are_evicted_until_the_bytes_bound_holds_never_the_one_just_stored(
    open_store: OpenStore,
) -> None:
    store = open_store(EngineShareSettings(max_bytes=MIB))
    first = add(store, 1, size=MIB // 2)
    second = add(store, 2, size=MIB // 2)
    assert store.total_bytes() == MIB
    big = add(store, 3, size=MIB + 1)  # over the bound alone: kept, everything else goes
    assert [e.record.key for e in store.entries()] == [big]
    assert first != second


def test_a_download_by_another_device_counts_as_a_reuse_and_its_builders_own_does_not(
    open_store: OpenStore,
) -> None:
    store = open_store(EngineShareSettings())
    key = add(store, 1)
    store.used(key, "dev-a")  # the builder (records.record_of: built_by dev-a)
    store.used(key, "dev-b")
    store.used(key, "dev-c")
    assert store.entries()[0].reuse == 2


def test_a_withdrawn_engine_is_gone_and_remembered_within_a_bound(
    open_store: OpenStore,
) -> None:
    store = open_store(EngineShareSettings())
    key = add(store, 1)
    assert store.withdraw(key, "did not load on dev-b")
    assert store.get(key) is None
    assert not store.withdraw(key, "again")
    assert [k for k, _sha in store.withdrawn()] == [key]
    for n in range(MAX_WITHDRAWN + 5):
        store.withdraw(add(store, 10 + n), "bad")
    assert len(store.withdrawn()) == MAX_WITHDRAWN


def test_the_index_survives_a_restart_and_an_unreadable_one_is_an_empty_store(tmp_path: Path) -> None:
    store = EngineStore(tmp_path, EngineShareSettings())
    key = add(store, 1)
    assert EngineStore(tmp_path, EngineShareSettings()).get(key) is not None
    (tmp_path / INDEX_FILE).write_text("{not json")
    assert EngineStore(tmp_path, EngineShareSettings()).entries() == []


def test_an_engine_whose_files_are_not_all_uploaded_is_never_stored(
    open_store: OpenStore,
) -> None:
    store = open_store(EngineShareSettings())
    record = record_of(offer(data=b"never uploaded"))
    with pytest.raises(ValueError, match="not uploaded"):
        store.add(sign_record(record, Ed25519PrivateKey.generate(), "ops"), record)


def test_a_controller_taking_over_keeps_the_withdrawn_engines_and_the_entries_whose_blobs_it_has(
    tmp_path: Path, postgres: PostgresServer
) -> None:
    """The index in PostgreSQL, two controllers' state directories: what one withdrew the other never
    takes again; an entry whose blobs are on the other host only is a cache miss there."""
    address = postgres.conninfo(postgres.new_database())
    first = PostgresEngineStore(tmp_path / "host-a", EngineShareSettings(), StateDatabase(address))
    first.create()
    kept, elsewhere, bad = add(first, 1), add(first, 2), add(first, 3)
    assert first.withdraw(bad, "did not load on dev-b")
    second_dir = tmp_path / "host-b"
    entry = first.get(kept)
    assert entry is not None
    (blob,) = entry.record.files
    (second_dir / "blobs").mkdir(parents=True)
    put_blob(second_dir / "blobs", first.blob_path(blob.sha256).read_bytes())  # host-b has kept's only
    second = PostgresEngineStore(second_dir, EngineShareSettings(), StateDatabase(address))
    second.create()
    assert [e.record.key for e in second.entries()] == [kept]
    assert second.get(elsewhere) is None
    assert [k for k, _sha in second.withdrawn()] == [bad]
    assert [n.reason for n in second.withdrawn_notes()] == ["did not load on dev-b"]
    unreadable = PostgresEngineStore(tmp_path / "host-c", EngineShareSettings(), StateDatabase(address))
    with psycopg.connect(address, autocommit=True) as pg:
        pg.execute("UPDATE engine_index SET doc = '{not json'")
    unreadable.create()  # a cache: an unreadable index is an empty store, never a failed start
    assert unreadable.entries() == []
