"""End to end: a fleet with a root of trust, real ``python -m agent run`` daemons and a real mosquitto.

The operator releases models offline (``fleet trust release``) and deploys them with the controller
key (``fleet deploy --release``). A thief who stole the controller key signs a model of their own:
every device refuses it, reports why, and keeps serving; a released model deploys after it as
before. Shadow and probation are on, as users run them, judging job ends only (fleet_rig).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from agent.cli import main
from agent.demo.broker import Broker
from agent.demo.modelzoo import write_classifier
from agent.fleet.deploy.keys import load_signing_key
from agent.fleet.deploy.plan import DeployPlan
from agent.fleet.deploy.run import FleetDeploy
from agent.fleet.trust import versions
from agent.fleet.trust.keyring import key_id_of
from agent.fleet.trust.releases import sign_release
from agent.protocol.manifest import KIB, build_manifest
from agent.protocol.messages import JobState
from agent.protocol.topics import Topics
from tests.e2e.fleet_rig import (
    ENDS_ONLY_PROBATION,
    Fleet,
    count_version,
    ends_only_shadow,
    finish,
    operator_settings,
)
from tests.mqtt_probe import Probe

pytestmark = pytest.mark.slow


def _release(trust: Path, model: Path, version: str, key: str = "release.key") -> Path:
    """``fleet trust release``'s file for ``model`` as slot ``cls`` deploys it (no new pre/postprocess)."""
    out = model.with_suffix(f".{version}.release.json")
    argv = ["fleet", "trust", "release", str(model), "--key", str(trust / "keys" / key), "--out", str(out)]
    assert main([*argv, "--model-id", "cls", "--version", version]) == 0
    return out


def _deploy(broker: Broker, trust: Path, model: Path, version: str, release: Path, devices: list[str]) -> int:
    argv = ["fleet", "deploy", str(model), "--slot", "cls", "--model-id", "cls", "--version", version]
    for device in devices:
        argv += ["--device", device]
    argv += ["--key", str(trust / "keys" / "controller.key"), "--release", str(release)]
    argv += ["--chunk-size", str(4 * KIB), "--timeout", "300", "--broker", f"{broker.host}:{broker.port}"]
    argv += ["--probation-s", "2", "--probation-json", ENDS_ONLY_PROBATION.model_dump_json()]
    argv += ["--shadow-json", ends_only_shadow().model_dump_json()]
    return main(argv)


def test_a_stolen_controller_key_ships_nothing_and_released_models_keep_deploying(
    fleet: Fleet, broker: Broker, tmp_path: Path
) -> None:
    trust = tmp_path / "trust"
    versions.init(trust, root_keys=3, threshold=2, expires_days=30)
    devices = [f"trust-{uuid.uuid4().hex[:6]}" for _ in range(2)]
    with Probe(broker.host, broker.port) as probe:
        for device in devices:
            probe.subscribe(f"fleet/v1/{device}/up/#")
        for device in devices:
            files = fleet.files(device, trust_root=str(trust / "root" / "1.root.json"))
            fleet.start(files)
        for device in devices:
            probe.wait_for(count_version("1", Topics("fleet/v1", device).results("cam")), timeout=120)
        v2 = fleet.root / devices[0] / "cls-v2.onnx"
        assert _deploy(broker, trust, v2, "2", _release(trust, v2, "2"), devices) == 0

        # The thief: the controller's key, a model of their own, and a release they sign with that key.
        evil = write_classifier(tmp_path / "evil.onnx", input_size=32, num_classes=4, seed=66)
        stolen = load_signing_key(trust / "keys" / "controller.key")
        manifest = build_manifest(evil, job_id="x", sequence=1, slot="cls", model_id="cls", version="6")
        forged = tmp_path / "forged.release.json"
        sign_release(manifest, [trust / "keys" / "controller.key"], forged, version=1, expires_days=30)
        for release in (None, forged.read_text()):
            plan = DeployPlan(model=evil, devices=tuple(devices), slot="cls", version="6", model_id="cls",
                              chunk_size=4 * KIB, shadow=ends_only_shadow(), probation_s=2.0,
                              probation=ENDS_ONLY_PROBATION)  # fmt: skip
            outcome = finish(
                FleetDeploy(
                    operator_settings(broker), plan, signing_key=stolen,
                    key_id=key_id_of(trust / "keys" / "controller.key"), release=release,
                ).start()
            )  # fmt: skip
            for device in devices:
                progress = outcome.devices[device]
                assert (progress.state, progress.error_code) == (JobState.REJECTED, "unreleased"), progress
                assert "release" in (progress.error or "")
        for device in devices:  # still serving the released model
            probe.clear()
            probe.wait_for(count_version("2", Topics("fleet/v1", device).results("cam")), timeout=60)

        v1 = fleet.root / devices[0] / "cls-v1.onnx"
        assert _deploy(broker, trust, v1, "3", _release(trust, v1, "3"), devices) == 0
        for device in devices:
            probe.wait_for(count_version("3", Topics("fleet/v1", device).results("cam")), timeout=60)
    for daemon in fleet.daemons:
        assert daemon.stop() == 0, daemon.log()[-3000:]
