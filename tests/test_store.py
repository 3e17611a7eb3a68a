"""ModelStore: verified atomic adoption, free-space check, garbage collection."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from agent.protocol.delivery_errors import DiskFullError, HashMismatchError
from agent.store import DiskUsage, ModelStore


def _part(tmp_path: Path, data: bytes, name: str = "x.part") -> tuple[Path, str]:
    path = tmp_path / "partial" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path, hashlib.sha256(data).hexdigest()


def test_adopt_moves_verified_file_into_place(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "models")
    src, sha = _part(tmp_path, b"model bytes")
    assert not store.has(sha)
    target = store.adopt(src, sha)
    assert target == store.path_for(sha) == tmp_path / "models" / f"{sha}.onnx"
    assert target.read_bytes() == b"model bytes"
    assert store.has(sha)
    assert not src.exists()
    assert store.models() == {sha: target}


def test_adopt_refuses_a_hash_mismatch_and_discards_the_file(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "models")
    src, _ = _part(tmp_path, b"what arrived")
    wanted = hashlib.sha256(b"what was announced").hexdigest()
    with pytest.raises(HashMismatchError) as info:
        store.adopt(src, wanted)
    assert info.value.code == "hash_mismatch"
    assert wanted in str(info.value)
    assert not src.exists()
    assert store.models() == {}


def test_path_for_refuses_anything_but_a_sha256(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "models")
    for bad in ("../../etc/passwd", "A" * 64, "abc"):
        with pytest.raises(ValueError, match="SHA-256"):
            store.path_for(bad)


def test_free_space_check(tmp_path: Path) -> None:
    """The free-space number is a test double (filling a real disk is not an option here)."""
    free = 5 * 1024 * 1024

    def usage(path: Path) -> DiskUsage:
        assert path == tmp_path / "models"
        return DiskUsage(total=10 * free, used=9 * free, free=free)

    store = ModelStore(tmp_path / "models", disk_usage=usage)
    store.check_free_space(4 * 1024 * 1024, 1024 * 1024)  # exactly fits
    with pytest.raises(DiskFullError) as info:
        store.check_free_space(4 * 1024 * 1024, 2 * 1024 * 1024)
    assert info.value.code == "disk_full"
    assert "need 6.0 MiB (model 4.0 MiB + headroom 2.0 MiB) but only 5.0 MiB is free" in str(info.value)
    # The real shutil.disk_usage is the default.
    ModelStore(tmp_path / "real").check_free_space(0, 0)


def test_gc_keeps_protected_and_newest(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "models")
    shas = []
    for i in range(5):
        src, sha = _part(tmp_path, f"model {i}".encode(), f"{i}.part")
        store.adopt(src, sha)
        os.utime(store.path_for(sha), (1000 + i, 1000 + i))  # model 4 is the newest
        shas.append(sha)
    stray = tmp_path / "models" / f".{shas[0]}.onnx.abc.tmp"
    stray.write_bytes(b"half")
    removed = store.gc(protect={shas[0]}, keep=2)
    assert set(store.models()) == {shas[0], shas[3], shas[4]}
    assert stray in removed
    assert not stray.exists()
    store.touch(shas[3])  # used again: now the newest unprotected
    store.gc(protect=set(), keep=1)
    assert set(store.models()) == {shas[3]}
