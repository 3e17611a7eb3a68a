"""Engine cache: hit/miss, corrupt or truncated entries become misses, LRU eviction, protection, size cap."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.engines.cache.key import (
    SIDECAR_NAME,
    EngineIdentity,
    EngineMeta,
    engine_cache_key,
    new_engine_meta,
)
from agent.engines.cache.store import LAST_USED_NAME, EngineCache
from agent.errors import BuildError


def identity(n: int) -> EngineIdentity:
    return EngineIdentity(
        model_sha256=f"{n:064x}",
        backend="onnxruntime",
        backend_version="1.31.0",
        precision="fp32",
        device="cpu",
        workspace_mb=1024,
        optimization_level=3,
    )


def meta_for(n: int) -> EngineMeta:
    return new_engine_meta(identity(n), build_seconds=1.5)


def key_of(n: int) -> str:
    return engine_cache_key(identity(n))


def store(cache: EngineCache, n: int, size: int = 1000) -> str:
    key = key_of(n)
    cache.put(key, bytes([n % 256]) * size, meta_for(n))
    return key


def test_miss_then_hit_returns_the_stored_engine(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path / "engines", 10**6)
    key = key_of(1)
    assert cache.get(key) is None
    cache.put(key, b"engine-bytes", meta_for(1), files={"report.json": b"{}"})
    entry = cache.get(key)
    assert entry is not None
    assert entry.engine_path.read_bytes() == b"engine-bytes"
    assert entry.meta.engine_bytes == len(b"engine-bytes")
    assert entry.meta.engine_sha256 is not None
    assert entry.file("report.json").read_bytes() == b"{}"
    assert entry.directory == tmp_path / "engines" / key
    # No staging or trash directory is left behind.
    assert [p.name for p in (tmp_path / "engines").iterdir()] == [key]


def test_put_moves_a_file_and_replaces_an_existing_entry(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path / "engines", 10**6)
    key = key_of(2)
    cache.put(key, b"old", meta_for(2))
    built = tmp_path / "built.onnx"
    built.write_bytes(b"new engine")
    cache.put(key, built, meta_for(2), move=True)
    entry = cache.get(key)
    assert entry is not None
    assert entry.engine_path.read_bytes() == b"new engine"
    assert not built.exists()


def test_corrupt_sidecar_is_a_miss_and_the_entry_is_removed(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path / "engines", 10**6)
    key = store(cache, 3)
    (cache.path_of(key) / SIDECAR_NAME).write_text("{not json", encoding="utf-8")
    assert cache.get(key) is None
    assert not cache.path_of(key).exists()
    # The rebuild path: storing again works and hits.
    store(cache, 3)
    assert cache.get(key) is not None


def test_sidecar_of_another_key_is_a_miss(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path / "engines", 10**6)
    key_a, key_b = store(cache, 4), store(cache, 5)
    os.replace(cache.path_of(key_b) / SIDECAR_NAME, cache.path_of(key_a) / SIDECAR_NAME)
    assert cache.get(key_a) is None
    assert cache.get(key_b) is None  # no sidecar at all now


def test_truncated_engine_is_a_miss(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path / "engines", 10**6)
    key = store(cache, 6, size=5000)
    entry = cache.get(key)
    assert entry is not None
    with entry.engine_path.open("r+b") as f:
        f.truncate(100)
    assert cache.get(key) is None
    assert key not in cache


def test_flipped_engine_bytes_are_a_miss(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path / "engines", 10**6)
    key = store(cache, 7, size=64)
    path = cache.path_of(key) / "engine"
    path.write_bytes(b"\xff" * 64)  # same size, different content
    assert cache.get(key) is None


def test_missing_engine_file_is_a_miss(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path / "engines", 10**6)
    key = store(cache, 8)
    (cache.path_of(key) / "engine").unlink()
    assert cache.get(key) is None


def test_put_refuses_a_meta_for_another_key_and_bad_names(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path / "engines", 10**6)
    with pytest.raises(BuildError, match="not"):
        cache.put(key_of(1), b"x", meta_for(2))
    with pytest.raises(BuildError, match="plain file name"):
        cache.put(key_of(1), b"x", meta_for(1), files={"../escape": b"x"})
    with pytest.raises(BuildError, match="SHA-256"):
        cache.path_of("../../etc")
    assert cache.keys() == []


def test_lru_order_follows_use(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path / "engines", 10**6)
    keys = [store(cache, n) for n in (10, 11, 12)]
    assert cache.keys() == keys
    assert cache.get(keys[0]) is not None  # now the most recently used
    assert cache.keys() == [keys[1], keys[2], keys[0]]


def test_eviction_removes_least_recently_used_to_fit(tmp_path: Path) -> None:
    # Each entry is ~1000 bytes of engine plus a sidecar of under 1500 bytes.
    cache = EngineCache(tmp_path / "engines", 7000)
    keys = [store(cache, n) for n in (20, 21)]
    entry_bytes = cache.total_bytes() // 2
    cache.max_bytes = 2 * entry_bytes + entry_bytes // 2  # room for two entries, not three
    assert cache.get(keys[0]) is not None  # 20 used after 21
    third = store(cache, 22)  # put evicts to fit
    assert set(cache.keys()) == {keys[0], third}
    assert cache.total_bytes() <= cache.max_bytes


def test_protected_keys_survive_eviction(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path / "engines", 10**6)
    keys = [store(cache, n) for n in (30, 31, 32, 33)]
    cache.protect({keys[0]})  # the oldest: the active engine
    cache.max_bytes = 1  # nothing fits
    evicted = cache.evict(protect={keys[1]})  # e.g. the last-known-good engine
    assert set(evicted) == {keys[2], keys[3]}
    assert set(cache.keys()) == {keys[0], keys[1]}
    assert cache.get(keys[0]) is not None
    assert cache.get(keys[1]) is not None


def test_a_new_entry_is_never_evicted_by_its_own_put(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path / "engines", 10)  # smaller than any entry
    key = store(cache, 40)
    assert cache.get(key) is not None
    other = store(cache, 41)
    assert cache.keys() == [other]


def test_size_cap_respected_over_many_puts(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path / "engines", 6000)
    for n in range(50, 62):
        store(cache, n)
        assert cache.total_bytes() <= 6000
    assert len(cache.keys()) >= 2


def test_entry_without_marker_counts_as_oldest(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path / "engines", 10**6)
    keys = [store(cache, n) for n in (70, 71)]
    (cache.path_of(keys[1]) / LAST_USED_NAME).unlink()
    assert cache.keys() == [keys[1], keys[0]]
    assert cache.get(keys[1]) is not None  # still valid, and the marker comes back
    assert (cache.path_of(keys[1]) / LAST_USED_NAME).exists()


def test_leftover_staging_and_trash_dirs_are_cleaned(tmp_path: Path) -> None:
    root = tmp_path / "engines"
    root.mkdir()
    stale = root / ".tmp-abc-123"
    stale.mkdir()
    (stale / "engine").write_bytes(b"partial")
    os.utime(stale, (0, 0))
    fresh = root / ".tmp-def-456"
    fresh.mkdir()  # may be another process staging right now
    (root / ".trash-abc").mkdir()
    cache = EngineCache(root, 10**6)
    assert not stale.exists()
    assert fresh.exists()
    assert not (root / ".trash-abc").exists()
    assert cache.keys() == []
