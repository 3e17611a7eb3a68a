"""The controller's engine store: bounded in count and bytes, least recently used first, withdrawals
remembered (bounded), blobs nobody refers to collected, an index that survives a restart."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.fleet.engines.settings import EngineShareSettings
from agent.fleet.engines.store import INDEX_FILE, MAX_WITHDRAWN, EngineStore
from agent.fleet.engines.trust import sign_record
from agent.signing import Ed25519PrivateKey
from tests.fleet.engines.records import offer, put_blob, record_of

MIB = 1024**2


def add(store: EngineStore, n: int, size: int = 16) -> str:
    key = f"{n:064x}"
    data = bytes([n % 256]) * size
    put_blob(store.blobs, data)
    record = record_of(offer(key=key, data=data))
    store.add(sign_record(record, Ed25519PrivateKey.generate(), "ops"), record)
    return key


def test_the_least_recently_used_engine_goes_first_when_the_count_bound_is_reached(tmp_path: Path) -> None:
    store = EngineStore(tmp_path, EngineShareSettings(max_entries=2))
    first, second = add(store, 1), add(store, 2)
    store.used(first, "dev-b")  # downloaded: now the most recently used
    third = add(store, 3)
    assert {e.record.key for e in store.entries()} == {first, third}
    assert second not in {p.name.removesuffix(".onnx") for p in store.blobs.iterdir()}  # its blob collected


def test_engines_are_evicted_until_the_bytes_bound_holds_never_the_one_just_stored(tmp_path: Path) -> None:
    store = EngineStore(tmp_path, EngineShareSettings(max_bytes=MIB))
    first = add(store, 1, size=MIB // 2)
    second = add(store, 2, size=MIB // 2)
    assert store.total_bytes() == MIB
    big = add(store, 3, size=MIB + 1)  # over the bound alone: kept, everything else goes
    assert [e.record.key for e in store.entries()] == [big]
    assert first != second


def test_a_download_by_another_device_counts_as_a_reuse_and_its_builders_own_does_not(tmp_path: Path) -> None:
    store = EngineStore(tmp_path, EngineShareSettings())
    key = add(store, 1)
    store.used(key, "dev-a")  # the builder (records.record_of: built_by dev-a)
    store.used(key, "dev-b")
    store.used(key, "dev-c")
    assert store.entries()[0].reuse == 2


def test_a_withdrawn_engine_is_gone_and_remembered_within_a_bound(tmp_path: Path) -> None:
    store = EngineStore(tmp_path, EngineShareSettings())
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


def test_an_engine_whose_files_are_not_all_uploaded_is_never_stored(tmp_path: Path) -> None:
    store = EngineStore(tmp_path, EngineShareSettings())
    record = record_of(offer(data=b"never uploaded"))
    with pytest.raises(ValueError, match="not uploaded"):
        store.add(sign_record(record, Ed25519PrivateKey.generate(), "ops"), record)
