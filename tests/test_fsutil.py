"""Atomic writes and file hashing, on the real file system."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any

import pytest

from agent.fsutil import (
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    atomic_writer,
    sha256_file,
    start_writeback,
)
from tests.page_cache import resident_bytes


def _leftovers(directory: Path, target: Path) -> list[str]:
    """Everything in ``directory`` except ``target``: temp files an atomic write must not leave."""
    return sorted(p.name for p in directory.iterdir() if p != target)


def test_write_bytes_creates_then_replaces(tmp_path: Path) -> None:
    target = tmp_path / "model.bin"
    atomic_write_bytes(target, b"first")
    assert target.read_bytes() == b"first"
    atomic_write_bytes(target, b"second, longer")
    assert target.read_bytes() == b"second, longer"
    assert _leftovers(tmp_path, target) == []


def test_replacement_is_a_new_inode(tmp_path: Path) -> None:
    """A reader holding the old file keeps reading the old bytes: the file is replaced, not rewritten."""
    target = tmp_path / "state.json"
    atomic_write_bytes(target, b"old contents")
    with open(target, "rb") as reader:
        atomic_write_bytes(target, b"new contents")
        assert reader.read() == b"old contents"
    assert target.read_bytes() == b"new contents"


def test_new_file_mode_is_0644_and_existing_mode_is_kept(tmp_path: Path) -> None:
    fresh = tmp_path / "fresh.txt"
    atomic_write_text(fresh, "x")
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o644

    secret = tmp_path / "secret.txt"
    atomic_write_text(secret, "one", mode=0o600)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    atomic_write_text(secret, "two")
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert secret.read_text() == "two"


def test_write_text_encodes_utf8(tmp_path: Path) -> None:
    target = tmp_path / "labels.txt"
    atomic_write_text(target, "café\nñandú\n")
    assert target.read_bytes() == "café\nñandú\n".encode()


def test_write_json_round_trips(tmp_path: Path) -> None:
    target = tmp_path / "meta.json"
    obj = {"name": "yolo", "shape": [1, 3, 640, 640], "ok": True, "ratio": 0.5, "none": None}
    atomic_write_json(target, obj)
    assert json.loads(target.read_text(encoding="utf-8")) == obj
    assert target.read_text(encoding="utf-8").endswith("\n")


def test_failing_serialiser_mid_write_keeps_old_file_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    atomic_write_json(target, {"version": 1})
    old = target.read_bytes()
    seen_during_write: list[list[str]] = []

    def failing_default(value: Any) -> Any:
        # By now the first part of the document has been streamed into the temporary file.
        seen_during_write.append(_leftovers(tmp_path, target))
        raise TypeError(f"cannot serialise {type(value).__name__}")

    big_prefix = "x" * 100_000  # large enough to be written out before the failing value
    with pytest.raises(TypeError, match="cannot serialise"):
        atomic_write_json(target, {"a": big_prefix, "b": object()}, default=failing_default)

    assert len(seen_during_write) == 1
    assert len(seen_during_write[0]) == 1, "the temporary file should exist while writing"
    assert seen_during_write[0][0].startswith(".state.json.")
    assert target.read_bytes() == old
    assert _leftovers(tmp_path, target) == []


def test_nan_is_refused_and_old_file_kept(tmp_path: Path) -> None:
    target = tmp_path / "meta.json"
    atomic_write_json(target, {"v": 1})
    with pytest.raises(ValueError, match="not JSON compliant"):
        atomic_write_json(target, {"v": float("nan")})
    assert json.loads(target.read_text()) == {"v": 1}
    assert _leftovers(tmp_path, target) == []


def test_exception_inside_writer_block_creates_nothing(tmp_path: Path) -> None:
    target = tmp_path / "engine.plan"

    def build() -> None:
        with atomic_writer(target) as f:
            f.write(b"partial engine bytes")
            raise RuntimeError("builder crashed")

    with pytest.raises(RuntimeError, match="builder crashed"):
        build()
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []


def test_streaming_writer_writes_all_chunks(tmp_path: Path) -> None:
    target = tmp_path / "big.bin"
    with atomic_writer(target) as f:
        for i in range(10):
            f.write(bytes([i]) * 1000)
    assert target.read_bytes() == b"".join(bytes([i]) * 1000 for i in range(10))


def test_missing_directory_fails_and_creates_nothing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        atomic_write_bytes(tmp_path / "no" / "such" / "file", b"x")
    assert list(tmp_path.iterdir()) == []


def test_sha256_file_matches_hashlib_across_block_boundaries(tmp_path: Path) -> None:
    data = os.urandom(1024 * 1024 * 2 + 12345)  # spans three 1 MiB blocks
    target = tmp_path / "model.onnx"
    target.write_bytes(data)
    assert sha256_file(target) == hashlib.sha256(data).hexdigest()


def test_sha256_of_empty_file(tmp_path: Path) -> None:
    target = tmp_path / "empty"
    target.write_bytes(b"")
    assert sha256_file(target) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


@pytest.mark.skipif(shutil.which("fincore") is None, reason="needs util-linux's fincore")
def test_bytes_whose_writeback_was_started_stay_in_the_page_cache(tmp_path: Path) -> None:
    """A download starts each chunk's writeback as it writes it; the whole-file hash that follows
    must still read the file from memory, not from the disk again."""
    path = tmp_path / "model.part"
    chunk = os.urandom(256 * 1024)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        for index in range(16):
            os.pwrite(fd, chunk, index * len(chunk))
            start_writeback(fd, index * len(chunk), len(chunk))
        os.fdatasync(fd)
    finally:
        os.close(fd)
    assert resident_bytes(path) >= 15 * len(chunk)  # a page written back at once may go
    assert path.read_bytes() == chunk * 16


def test_starting_writeback_where_the_descriptor_refuses_it_is_no_error() -> None:
    """Only an earlier start of the work the fsync does anyway: a pipe (ESPIPE) is not a failure."""
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, b"x")
        start_writeback(write_end, 0, 1)
        assert os.read(read_end, 1) == b"x"
    finally:
        os.close(read_end)
        os.close(write_end)
