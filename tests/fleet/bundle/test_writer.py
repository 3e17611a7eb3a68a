"""``fleet bundle``'s file: each carried file once, in the index's order, streamed (a large model is
never held in memory, writing or importing), and a missing file named before anything is written."""

from __future__ import annotations

import os
import tarfile
import tracemalloc
from pathlib import Path

import pytest

from agent.config import load_config
from agent.errors import UsageError
from agent.fleet.bundle.retained import Published
from agent.fleet.bundle.writer import find_files, needed_files, write_bundle
from agent.lifecycle.bundle.importer import import_bundle
from agent.store import ModelStore
from agent.trust.bundle import INDEX_MEMBER, blob_member
from tests.e2e.daemon import AgentFiles
from tests.lifecycle.bundle.bundles import BundleTrust

#: A model far larger than anything the writer or the reader may hold in memory at once.
LARGE = 48 * 1024 * 1024
#: What writing or importing it may allocate at its peak (buffers, the index, the manifest).
PEAK_BOUND = 8 * 1024 * 1024


def test_two_devices_deployed_the_same_model_carry_it_once_after_their_desired_states(tmp_path: Path) -> None:
    trust = BundleTrust.init(tmp_path / "trust")
    model = tmp_path / "repo" / "m.onnx"
    model.parent.mkdir()
    model.write_bytes(os.urandom(20_000))
    desired = {d: {"cls": trust.desired(model, device=d, version="2")[1]} for d in ("cam-a", "cam-b")}
    published = Published(desired=desired, root_chain=trust.chain())
    files = find_files(needed_files(published), [model.parent])
    key, key_id = trust.controller()

    summary = write_bundle(tmp_path / "two.bundle", published, files, key=key, key_id=key_id)

    with tarfile.open(summary.path) as tar:
        names = tar.getnames()
    sha = next(iter(files))
    assert names == [
        INDEX_MEMBER,
        "trust/root.json",
        "desired/cam-a/cls",
        "desired/cam-b/cls",
        blob_member(sha),
    ]
    assert not (tmp_path / "two.bundle.part").exists()


def test_a_file_the_desired_states_name_but_nobody_holds_is_named_before_anything_is_written(
    tmp_path: Path,
) -> None:
    trust = BundleTrust.init(tmp_path / "trust")
    model = tmp_path / "elsewhere" / "m.onnx"
    model.parent.mkdir()
    model.write_bytes(os.urandom(5000))
    published = Published(desired={"cam-a": {"cls": trust.desired(model, device="cam-a", version="2")[1]}})
    (tmp_path / "repo").mkdir()

    with pytest.raises(
        UsageError, match=r"not found in .*repo.*name the directory holding the deployed model"
    ):
        find_files(needed_files(published), [tmp_path / "repo"])


def test_a_large_model_is_streamed_into_the_bundle_and_onto_the_device(tmp_path: Path) -> None:
    trust = BundleTrust.init(tmp_path / "trust")
    model = tmp_path / "repo" / "big.onnx"
    model.parent.mkdir()
    with open(model, "wb") as f:
        for _ in range(LARGE // (1024 * 1024)):
            f.write(os.urandom(1024 * 1024))
    files = AgentFiles(tmp_path / "cam-a", 1, "cam-a", frames=2)
    files.write_config(delivery={"trust_root": str(trust.anchor)})
    config = load_config(files.config_path, require_models=False)
    manifest, payload = trust.desired(model, device="cam-a", version="2")
    published = Published(desired={"cam-a": {"cls": payload}}, root_chain=trust.chain())
    found = find_files(needed_files(published), [model.parent])
    key, key_id = trust.controller()

    tracemalloc.start()
    try:
        summary = write_bundle(tmp_path / "big.bundle", published, found, key=key, key_id=key_id)
        _, writing = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        import_bundle(summary.path, config)
        _, importing = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert summary.size > LARGE
    assert ModelStore(config.state_dir / "models").has(manifest.sha256)
    assert writing < PEAK_BOUND, writing
    assert importing < PEAK_BOUND, importing
