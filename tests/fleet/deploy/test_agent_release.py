"""An agent release made from a directory of wheels, and read back checked against its document."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from agent.errors import ConfigError
from agent.fleet.deploy.agent_release import RELEASE_FILE, make_release, read_release_dir, write_release
from agent.fleet.deploy.manifest import target_manifest
from agent.protocol.device_targets import AGENT_TARGET


def _wheels(tmp: Path, *names: str) -> Path:
    folder = tmp / "wheels"
    folder.mkdir()
    for i, name in enumerate(names):
        (folder / name).write_bytes(f"wheel {i} {name}".encode() * (i + 3))
    return folder


def test_a_release_names_every_wheel_by_size_and_sha256_with_python_and_machine_from_the_tags(
    tmp_path: Path,
) -> None:
    folder = _wheels(
        tmp_path,
        "edge_agent-0.3.0-py3-none-any.whl",
        "numpy-1.26.4-cp310-cp310-manylinux_2_17_aarch64.manylinux2014_aarch64.whl",
        "cryptography-42.0.5-cp39-abi3-manylinux_2_28_aarch64.whl",  # the stable ABI: any later Python
    )
    release = make_release(folder, version="0.3.0")
    assert release.python == "3.10"
    assert release.platforms == ["aarch64"]
    by_name = {w.filename: w for w in release.wheels}
    for path in folder.iterdir():
        assert by_name[path.name].size == path.stat().st_size
        assert by_name[path.name].sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    document = write_release(folder, release)
    assert json.loads(document.read_text())["version"] == "0.3.0"
    read = read_release_dir(folder)
    assert [n for n, _ in read.wheels] == [w.filename for w in release.wheels]


def test_pure_python_wheels_need_the_python_and_machine_said(tmp_path: Path) -> None:
    folder = _wheels(tmp_path, "edge_agent-0.3.0-py3-none-any.whl")
    with pytest.raises(ConfigError, match="--python"):
        make_release(folder, version="0.3.0")
    with pytest.raises(ConfigError, match="--platform"):
        make_release(folder, version="0.3.0", python="3.10")
    release = make_release(folder, version="0.3.0", python="3.10", platforms=["x86_64"])
    assert release.platforms == ["x86_64"]


def test_wheels_for_two_pythons_or_two_machines_are_refused(tmp_path: Path) -> None:
    folder = _wheels(
        tmp_path,
        "a-1-cp310-cp310-linux_aarch64.whl",
        "b-1-cp311-cp311-linux_aarch64.whl",
    )
    with pytest.raises(ConfigError, match=r"several Python versions \(3.10, 3.11\)"):
        make_release(folder, version="1")
    (folder / "b-1-cp311-cp311-linux_aarch64.whl").rename(folder / "b-1-cp310-cp310-linux_x86_64.whl")
    with pytest.raises(ConfigError, match="several machines"):
        make_release(folder, version="1")


def test_a_wheel_changed_or_missing_after_the_release_was_made_is_named(tmp_path: Path) -> None:
    folder = _wheels(tmp_path, "a-1-cp310-cp310-linux_aarch64.whl", "b-1-py3-none-any.whl")
    write_release(folder, make_release(folder, version="1"))
    (folder / "b-1-py3-none-any.whl").write_bytes(b"another build")
    with pytest.raises(ConfigError, match=r"b-1-py3-none-any\.whl: not the wheel the release names"):
        read_release_dir(folder)
    (folder / "b-1-py3-none-any.whl").unlink()
    with pytest.raises(ConfigError, match=r"names b-1-py3-none-any\.whl, which is not in the directory"):
        read_release_dir(folder)
    (folder / RELEASE_FILE).unlink()
    with pytest.raises(ConfigError, match="fleet agent release"):
        read_release_dir(folder)


def test_the_release_manifest_carries_the_document_and_every_wheel_as_a_wheel_artifact(
    tmp_path: Path,
) -> None:
    names = [f"dep{i}-1.0-cp310-cp310-linux_aarch64.whl" for i in range(20)]
    folder = _wheels(tmp_path, *names)
    write_release(folder, make_release(folder, version="1.0"))
    read = read_release_dir(folder)
    manifest = target_manifest(AGENT_TARGET, read.document, version="1.0", wheels=read.wheels)
    assert manifest.slot == "_agent"
    assert manifest.model_id == "edge-agent"
    assert manifest.sha256 == hashlib.sha256(read.document.read_bytes()).hexdigest()
    assert sorted(a.name for a in manifest.artifacts or ()) == sorted(names)  # more than a model's 8
    assert {a.kind for a in manifest.artifacts or ()} == {"wheel"}
