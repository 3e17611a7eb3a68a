"""Model uploads into the controller's repository on a real small disk (tmpfs) that fills up."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from agent.fleet.controller.upload import PIECE_SIZE, UploadError, UploadSink
from tests.small_disk import small_disk


def _piece(sink: UploadSink, data: bytes, sha: str, offset: int) -> dict[str, object]:
    piece = data[offset : offset + PIECE_SIZE]
    return sink.take(piece, {"sha256": sha, "offset": str(offset), "size": str(len(data))})


def test_a_piece_the_full_disk_cuts_short_is_not_kept_and_the_upload_resumes_once_space_is_back(
    tmp_path: Path,
) -> None:
    data = os.urandom(3 * PIECE_SIZE - 123)
    sha = hashlib.sha256(data).hexdigest()
    with small_disk(tmp_path / "disk", "8m") as disk:
        models = disk.path / "models"
        sink = UploadSink(models)
        part = models / f".upload-{sha}.part"
        assert _piece(sink, data, sha, 0) == {"have": PIECE_SIZE, "complete": False}
        # Half a piece of room: the write stops part-way (ENOSPC), and that half must not stay.
        squeeze = disk.path / "squeeze"
        squeeze.write_bytes(b"\0" * (disk.free_bytes() - PIECE_SIZE // 2))
        with pytest.raises(UploadError, match=r"No space left on device.*nothing of it was kept"):
            _piece(sink, data, sha, PIECE_SIZE)
        assert part.stat().st_size == PIECE_SIZE, "the piece's first half stayed behind"
        squeeze.unlink()
        assert _piece(sink, data, sha, PIECE_SIZE) == {"have": 2 * PIECE_SIZE, "complete": False}
        assert _piece(sink, data, sha, 2 * PIECE_SIZE) == {"have": len(data), "complete": True}
        assert (models / f"{sha}.onnx").read_bytes() == data
        assert sorted(p.name for p in models.iterdir()) == [f"{sha}.onnx"]


def test_a_first_piece_on_a_full_disk_leaves_no_file(tmp_path: Path) -> None:
    data = os.urandom(PIECE_SIZE + 1)
    sha = hashlib.sha256(data).hexdigest()
    with small_disk(tmp_path / "disk", "4m") as disk:
        models = disk.path / "models"
        models.mkdir()
        disk.fill()
        with pytest.raises(UploadError, match=r"offset 0 .*No space left on device"):
            _piece(UploadSink(models), data, sha, 0)
        assert list(models.iterdir()) == []
