"""``edge-agent import``'s checks on real bundle files and a real state directory: what a good bundle
puts where, and every kind of bad bundle refused by name with nothing changed."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.cli import main
from agent.config import AgentConfig, load_config
from agent.fleet.bundle.retained import Published
from agent.fleet.bundle.writer import find_files, needed_files, write_bundle
from agent.fleet.deploy.keys import load_signing_key, write_keypair
from agent.fleet.trust.keyring import key_id_of
from agent.lifecycle.bundle.importer import import_bundle
from agent.lifecycle.bundle.inbox import ImportedStates
from agent.protocol.device_targets import AGENT_TARGET, CONFIG_TARGET
from agent.protocol.manifest import build_manifest, describe_artifact, sign_manifest
from agent.protocol.topics import Topics, trust_root
from agent.store import ModelStore
from agent.trust.bundle import BundleError, blob_member, desired_member
from tests.e2e.daemon import AgentFiles
from tests.lifecycle.bundle.bundles import (
    BundleTrust,
    device_target_files,
    device_target_states,
    rewrite,
    write_test_bundle,
)
from tests.small_disk import small_disk

DEVICE = "bundle-cam"
OTHER = "bundle-other"


@dataclass
class Setup:
    trust: BundleTrust
    files: AgentFiles
    config: AgentConfig
    bundle: Path
    payload: bytes
    model_sha: str
    calibration_sha: str


@pytest.fixture
def setup(tmp_path: Path) -> Setup:
    trust = BundleTrust.init(tmp_path / "trust")
    files = AgentFiles(tmp_path / DEVICE, 1, DEVICE, frames=2)
    files.write_config(delivery={"trust_root": str(trust.anchor)})
    config = load_config(files.config_path, require_models=False)
    calibration = tmp_path / "repo" / "calib.cache"
    calibration.parent.mkdir()
    calibration.write_bytes(os.urandom(5000))
    artifact = describe_artifact(calibration, name="calib", kind="calibration")
    manifest, payload = trust.desired(files.v2, device=DEVICE, version="2", artifacts=[artifact])
    _, other = trust.desired(files.v1, device=OTHER, version="7")
    bundle = write_test_bundle(
        tmp_path / "fleet.bundle",
        trust,
        {DEVICE: {"cls": payload}, OTHER: {"cls": other}},
        [files.root, calibration.parent],
    )
    return Setup(trust, files, config, bundle, payload, manifest.sha256, artifact.sha256)


def state_files(state_dir: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(state_dir)): p.read_bytes() for p in sorted(state_dir.rglob("*")) if p.is_file()
    }


def test_a_bundle_puts_its_files_in_the_stores_and_keeps_the_desired_state_for_the_agent(
    setup: Setup,
) -> None:
    report = import_bundle(setup.bundle, setup.config)

    assert [(t.target, t.version) for t in report.targets] == [("cls", "2")]
    assert (report.copied, report.present, report.root_version) == (2, 0, 1)
    assert ModelStore(setup.config.state_dir / "models").has(setup.model_sha)
    assert ModelStore(setup.config.state_dir / "artifacts").has(setup.calibration_sha)
    kept = ImportedStates(setup.config.state_dir).messages(Topics("fleet/v1", DEVICE))
    assert [m.topic for m in kept] == [trust_root("fleet/v1"), Topics("fleet/v1", DEVICE).desired("cls")]
    assert kept[1].payload == setup.payload
    assert not (setup.config.state_dir / "partial" / f"bundle-{os.getpid()}").exists()

    again = import_bundle(setup.bundle, setup.config)  # the files are there already: nothing copied
    assert (again.copied, again.present) == (0, 2)


def test_configuration_and_agent_release_entries_are_checked_and_kept_like_a_model(
    setup: Setup, tmp_path: Path
) -> None:
    states = device_target_states(setup.trust, tmp_path / "targets", DEVICE)
    desired = {"cls": setup.payload, **{target: payload for target, (_, payload) in states.items()}}
    bundle = write_test_bundle(
        tmp_path / "whole.bundle",
        setup.trust,
        {DEVICE: desired},
        [setup.files.root, tmp_path / "repo", tmp_path / "targets"],
    )

    report = import_bundle(bundle, setup.config)

    assert sorted((t.target, t.version) for t in report.targets) == [
        ("_agent", "9.9.9"),
        ("_config", "c1"),
        ("cls", "2"),
    ]
    models = ModelStore(setup.config.state_dir / "models")
    artifacts = ModelStore(setup.config.state_dir / "artifacts")
    agent_manifest = states[AGENT_TARGET][0]
    assert models.has(states[CONFIG_TARGET][0].sha256)  # the overlay, fetched as a model's bytes would be
    assert models.has(agent_manifest.sha256)  # the release document
    assert all(artifacts.has(w.sha256) for w in agent_manifest.artifacts or ())  # its wheels, as artifacts
    topics = Topics("fleet/v1", DEVICE)
    kept = {m.topic: m.payload for m in ImportedStates(setup.config.state_dir).messages(topics)}
    assert kept[topics.desired(CONFIG_TARGET)] == states[CONFIG_TARGET][1]
    assert kept[topics.desired(AGENT_TARGET)] == states[AGENT_TARGET][1]


def test_a_configuration_released_as_a_model_is_refused(setup: Setup, tmp_path: Path) -> None:
    overlay = device_target_files(tmp_path / "targets")[0]
    # The overlay's bytes released for the slot cls, named by a desired state of _config: kinds differ.
    manifest, _ = setup.trust.desired(overlay, device=DEVICE, version="c1", slot="cls", sequence=1)
    forged = manifest.model_copy(update={"slot": CONFIG_TARGET, "job_id": "forged-config"})
    release = (overlay.with_suffix(".cls.c1.release.json")).read_text()
    key, key_id = setup.trust.controller()
    payload = sign_manifest(forged, key, key_id, release=release)
    bundle = write_test_bundle(
        tmp_path / "kind.bundle", setup.trust, {DEVICE: {CONFIG_TARGET: payload}}, [tmp_path / "targets"]
    )

    with pytest.raises(BundleError, match=r"refused \(unreleased\)"):
        import_bundle(bundle, setup.config)


def test_the_import_command_prints_what_it_handed_over(
    setup: Setup, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["import", str(setup.bundle), "--config", str(setup.files.config_path)]) == 0
    out = capsys.readouterr().out
    assert "cls: job bundle-bundle-cam-cls-2 (version 2) handed to the agent" in out
    assert "the agent takes them when it starts" in out


def _other_device_only(setup: Setup, tmp_path: Path) -> Path:
    _, other = setup.trust.desired(setup.files.v1, device=OTHER, version="7")
    return write_test_bundle(
        tmp_path / "other.bundle", setup.trust, {OTHER: {"cls": other}}, [setup.files.root]
    )


def _tampered_model(setup: Setup, tmp_path: Path) -> Path:
    data = bytearray(setup.files.v2.read_bytes())
    data[len(data) // 2] ^= 0xFF
    return rewrite(setup.bundle, tmp_path / "t.bundle", {blob_member(setup.model_sha): bytes(data)})


def _tampered_desired_state(setup: Setup, tmp_path: Path) -> Path:
    altered = setup.payload.replace(b'\\"version\\":\\"2\\"', b'\\"version\\":\\"9\\"')
    assert altered != setup.payload
    return rewrite(setup.bundle, tmp_path / "t.bundle", {desired_member(DEVICE, "cls"): altered})


def _signed_by(setup: Setup, tmp_path: Path, *, claimed_id: bool) -> Path:
    stranger = write_keypair(tmp_path / "stranger")
    key_id = setup.trust.controller()[1] if claimed_id else key_id_of(stranger.private)
    return write_test_bundle(
        tmp_path / "u.bundle",
        setup.trust,
        {DEVICE: {"cls": setup.payload}},
        [setup.files.root, tmp_path / "repo"],
        key=(load_signing_key(stranger.private), key_id),
    )


def _unknown_key(setup: Setup, tmp_path: Path) -> Path:
    return _signed_by(setup, tmp_path, claimed_id=False)


def _forged_controller_signature(setup: Setup, tmp_path: Path) -> Path:
    return _signed_by(setup, tmp_path, claimed_id=True)


def _unreleased(setup: Setup, tmp_path: Path) -> Path:
    _, unreleased = setup.trust.desired(setup.files.v2, device=DEVICE, version="3", released=False)
    return write_test_bundle(
        tmp_path / "r.bundle", setup.trust, {DEVICE: {"cls": unreleased}}, [setup.files.root]
    )


def _truncated(setup: Setup, tmp_path: Path) -> Path:
    out = tmp_path / "cut.bundle"
    data = setup.bundle.read_bytes()
    out.write_bytes(data[: len(data) // 2])
    return out


def _path_traversal(setup: Setup, tmp_path: Path) -> Path:
    return rewrite(
        setup.bundle, tmp_path / "p.bundle", {}, inserted=(2, "../../etc/cron.d/evil", b"* * * * * root sh\n")
    )


def _not_a_bundle(setup: Setup, tmp_path: Path) -> Path:
    out = tmp_path / "notes.txt"
    out.write_text("not a bundle\n" * 100)
    return out


BAD: dict[str, tuple[Callable[[Setup, Path], Path], str]] = {
    "another device's": (_other_device_only, f"not for this device ({DEVICE})"),
    "a tampered model": (_tampered_model, "the file was altered or damaged"),
    "a tampered desired state": (_tampered_desired_state, "the file was altered or damaged"),
    "signed by an unknown key": (_unknown_key, "the bundle's signature is refused (unknown_key)"),
    "signed by another key under the controller's id": (
        _forged_controller_signature,
        "the bundle's signature is refused (bad_signature)",
    ),
    "an unreleased entry": (_unreleased, "the desired state is refused (unreleased)"),
    "truncated": (_truncated, "truncated"),
    "a path traversal member": (_path_traversal, "path traversal"),
    "not a tar": (_not_a_bundle, "not a bundle"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_bundle_is_refused_naming_what_was_wrong_and_changes_nothing(
    setup: Setup, tmp_path: Path, case: str
) -> None:
    make, says = BAD[case]
    bad = make(setup, tmp_path)
    state = setup.config.state_dir
    state.mkdir(parents=True, exist_ok=True)
    (state / "jobs.json").write_text("{}")  # something the device had before
    before = state_files(state)

    with pytest.raises(BundleError) as refused:
        import_bundle(bad, setup.config)

    assert says in str(refused.value)
    assert state_files(state) == before


def test_a_device_without_a_fleet_root_checks_the_bundle_with_its_trusted_keys(tmp_path: Path) -> None:
    keys = write_keypair(tmp_path / "keys")
    files = AgentFiles(tmp_path / DEVICE, 1, DEVICE, frames=2)
    files.write_config(delivery={"trusted_keys": {keys.key_id: str(keys.public)}})
    config = load_config(files.config_path, require_models=False)
    manifest = build_manifest(files.v2, job_id="plain-2", sequence=2, slot="cls", model_id="cls", version="2")
    payload = sign_manifest(manifest, load_signing_key(keys.private), keys.key_id)
    published = Published(desired={DEVICE: {"cls": payload}})
    found = find_files(needed_files(published), [files.root])
    good = write_bundle(
        tmp_path / "plain.bundle", published, found, key=load_signing_key(keys.private), key_id=keys.key_id
    )
    stranger = write_keypair(tmp_path / "stranger", key_id=keys.key_id)
    forged = write_bundle(
        tmp_path / "forged.bundle",
        published,
        found,
        key=load_signing_key(stranger.private),
        key_id=keys.key_id,
    )

    with pytest.raises(BundleError, match="bad_signature"):
        import_bundle(forged.path, config)
    assert import_bundle(good.path, config).targets[0].job_id == "plain-2"
    assert ModelStore(config.state_dir / "models").has(manifest.sha256)


def test_a_full_disk_refuses_the_import_by_name_and_changes_nothing(setup: Setup, tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk") as disk:
        files = AgentFiles(tmp_path / "full", 1, DEVICE, frames=2)
        files.write_config(
            delivery={"trust_root": str(setup.trust.anchor)}, state_dir=str(disk.path / "state")
        )
        config = load_config(files.config_path, require_models=False)
        config.state_dir.mkdir()
        (config.state_dir / "jobs.json").write_text("{}")
        disk.fill()
        before = state_files(config.state_dir)

        with pytest.raises(BundleError, match="not enough disk space"):
            import_bundle(setup.bundle, config)

        assert state_files(config.state_dir) == before
