"""Whether a release can run here (before anything changes), and the wheels held by hash."""

from __future__ import annotations

import hashlib
import platform
import sys
from pathlib import Path

import pytest

from agent.lifecycle.release.wheels import WheelCache, held_wheels, incompatible_because
from agent.protocol.delivery_errors import AgentInstallFailedError
from agent.protocol.device_targets import AgentRelease, AgentWheel

HERE = f"{sys.version_info.major}.{sys.version_info.minor}"
OTHER_MACHINE = "armv7l" if platform.machine() != "armv7l" else "x86_64"


def release(*filenames: str, **fields: object) -> AgentRelease:
    wheels = [{"filename": name, "sha256": "ab" * 32, "size": 1} for name in filenames]
    values = {"version": "1.2.0", "python": HERE, "platforms": [platform.machine()], "wheels": wheels}
    return AgentRelease.model_validate({**values, **fields})


def test_a_pure_python_release_for_this_python_and_machine_can_run_here() -> None:
    assert incompatible_because(release("edge_agent-1.2.0-py3-none-any.whl")) is None


@pytest.mark.parametrize(
    ("made", "why"),
    [
        (release("edge_agent-1.2.0-py3-none-any.whl", python="3.9"), "the release is for Python 3.9"),
        (release("edge_agent-1.2.0-py3-none-any.whl", platforms=[OTHER_MACHINE]), f"is for {OTHER_MACHINE}"),
        (
            release("edge_agent-1.2.0-py3-none-any.whl", "numpy-2.0.0-cp39-cp39-linux_armv7l.whl"),
            "numpy-2.0.0-cp39-cp39-linux_armv7l.whl cannot be installed here",
        ),
        (release("edge_agent-1.1.0-py3-none-any.whl"), "no wheel of edge-agent 1.2.0"),
    ],
    ids=["other-python", "other-machine", "wheel-tags", "no-agent-wheel"],
)
def test_a_release_that_cannot_run_here_is_named_with_the_reason(made: AgentRelease, why: str) -> None:
    reason = incompatible_because(made)
    assert reason is not None
    assert why in reason


def wheel_file(tmp_path: Path, name: str, data: bytes) -> tuple[AgentWheel, Path]:
    path = tmp_path / "delivered" / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    return AgentWheel(filename=name, sha256=hashlib.sha256(data).hexdigest(), size=len(data)), path


def test_a_delivered_wheel_is_checked_held_and_then_used_without_a_delivery(
    tmp_path: Path,
) -> None:
    cache = WheelCache(tmp_path / "releases")
    wheel, delivered = wheel_file(tmp_path, "dep-1.0-py3-none-any.whl", b"wheel bytes")
    held = cache.take(wheel, {wheel.filename: delivered})
    assert held.read_bytes() == b"wheel bytes"
    assert held_wheels(tmp_path) == {wheel.sha256}
    delivered.unlink()
    assert cache.take(wheel, {}) == held


def test_a_held_wheel_that_changed_on_disk_is_replaced_by_the_delivered_one(tmp_path: Path) -> None:
    cache = WheelCache(tmp_path / "releases")
    wheel, delivered = wheel_file(tmp_path, "dep-1.0-py3-none-any.whl", b"wheel bytes")
    held = cache.take(wheel, {wheel.filename: delivered})
    held.write_bytes(b"rotten bytes")
    with pytest.raises(AgentInstallFailedError, match="neither delivered nor held"):
        cache.take(wheel, {})
    assert cache.take(wheel, {wheel.filename: delivered}).read_bytes() == b"wheel bytes"


def test_a_delivered_wheel_of_other_bytes_is_refused_and_not_held(tmp_path: Path) -> None:
    cache = WheelCache(tmp_path / "releases")
    wheel, delivered = wheel_file(tmp_path, "dep-1.0-py3-none-any.whl", b"wheel bytes")
    delivered.write_bytes(b"other bytes")
    with pytest.raises(AgentInstallFailedError, match="SHA-256 is not the release's"):
        cache.take(wheel, {wheel.filename: delivered})
    assert held_wheels(tmp_path) == frozenset()


def test_only_the_wheels_of_releases_kept_stay(tmp_path: Path) -> None:
    cache = WheelCache(tmp_path / "releases")
    kept, first = wheel_file(tmp_path, "a-1.0-py3-none-any.whl", b"a")
    dropped, second = wheel_file(tmp_path, "b-1.0-py3-none-any.whl", b"b")
    cache.take(kept, {kept.filename: first})
    cache.take(dropped, {dropped.filename: second})
    cache.keep_only([kept.sha256])
    assert held_wheels(tmp_path) == {kept.sha256}
