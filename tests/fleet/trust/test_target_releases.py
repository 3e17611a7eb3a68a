"""``fleet trust release --overlay`` and ``--agent-release``: the release key signs a configuration
overlay or an agent release offline, and a device's own release check takes the desired state a
rollout makes of it, bound to its kind, its version and every wheel."""

from __future__ import annotations

import secrets
from datetime import datetime, timezone
from pathlib import Path

import pytest

from agent.cli import main
from agent.fleet.deploy.agent_release import make_release, read_release_dir, write_release
from agent.fleet.deploy.manifest import plan_manifest, target_manifest
from agent.fleet.deploy.plan import DeployPlan
from agent.fleet.trust import versions
from agent.protocol.delivery_errors import UnreleasedError
from agent.protocol.device_targets import AGENT_TARGET, CONFIG_TARGET
from agent.trust.release import check_release


def _now() -> datetime:
    return datetime.now(timezone.utc)


def test_a_signed_overlay_is_released_as_a_configuration_and_nothing_else(tmp_path: Path) -> None:
    root = versions.init(tmp_path / "trust", root_keys=1, threshold=1, expires_days=30)
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("telemetry:\n  interval_s: 30\n")
    out = tmp_path / "config.release.json"
    key = tmp_path / "trust" / "keys" / "release.key"
    argv = ["fleet", "trust", "release", "--overlay", str(overlay), "--version", "cfg-4", "--key", str(key)]
    assert main([*argv, "--out", str(out)]) == 0
    text = out.read_text()
    # The desired state a rollout publishes: its own job id and sequence, the watch window.
    published = target_manifest(CONFIG_TARGET, overlay, version="cfg-4").model_copy(
        update={"job_id": "config-cfg-4-x", "sequence": 7, "probation_s": 60.0, "device": "jet-1"}
    )
    check_release(root, text, published, _now())
    with pytest.raises(UnreleasedError):
        check_release(root, text, published.model_copy(update={"version": "cfg-5"}), _now())
    # The same bytes deployed as a model are not what was released.
    as_model = plan_manifest(
        DeployPlan(model=overlay, devices=(), slot="main", version="cfg-4", model_id="config"), "m", 1
    )
    with pytest.raises(UnreleasedError):
        check_release(root, text, as_model, _now())


def test_an_agent_release_binds_every_wheel(tmp_path: Path) -> None:
    root = versions.init(tmp_path / "trust", root_keys=1, threshold=1, expires_days=30)
    folder = tmp_path / "release"
    folder.mkdir()
    for name in ("edge_agent-0.4.0-py3-none-any.whl", "numpy-1.26.4-cp310-cp310-linux_aarch64.whl"):
        (folder / name).write_bytes(secrets.token_bytes(2000))
    write_release(folder, make_release(folder, version="0.4.0"))
    out = tmp_path / "agent.release.json"
    key = tmp_path / "trust" / "keys" / "release.key"
    argv = ["fleet", "trust", "release", "--agent-release", str(folder), "--key", str(key), "--out", str(out)]
    assert main(argv) == 0
    read = read_release_dir(folder)
    published = target_manifest(AGENT_TARGET, read.document, version="0.4.0", wheels=read.wheels)
    check_release(root, out.read_text(), published, _now())
    # One wheel swapped after the signature: the desired state is not the released one.
    swapped = tmp_path / "numpy-1.26.4-cp310-cp310-linux_aarch64.whl"
    swapped.write_bytes(secrets.token_bytes(2000))
    other = target_manifest(
        AGENT_TARGET, read.document, version="0.4.0", wheels=(read.wheels[0], (swapped.name, swapped))
    )
    with pytest.raises(UnreleasedError, match="not the released ones"):
        check_release(root, out.read_text(), other, _now())
