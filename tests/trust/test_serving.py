"""The release keys a device keeps per model it took: a revoked one flags the model, a restart keeps
the keys, a re-release clears the flag, and what is kept stays bounded."""

from __future__ import annotations

from pathlib import Path

from tuf.api.metadata import Metadata, Targets

from agent.protocol.manifest import DeployManifest
from agent.trust.release import release_for
from agent.trust.roles import REVOKED_FIELD
from agent.trust.serving import MAX_KEPT, ServingReleases
from tests.trust.fleet_keys import FleetKeys, in_days, model_manifest, signer


def _release(manifest: DeployManifest, keys: FleetKeys) -> Metadata[Targets]:
    release = release_for(manifest, version=1, expires=in_days(30))
    release.sign(keys.release, append=True)
    return release


def test_a_model_released_under_a_revoked_key_is_flagged_across_a_restart_until_re_released(
    tmp_path: Path,
) -> None:
    keys = FleetKeys()
    manifest = model_manifest(tmp_path)
    kept = ServingReleases(tmp_path / "trust" / "releases.json")
    kept.note(manifest.sha256, _release(manifest, keys))
    old = keys.release.public_key.keyid
    assert kept.revoked(keys.root(1), manifest.sha256) is None
    keys.release = signer()
    root = keys.root(2, sign_with=0)
    root.signed.unrecognized_fields[REVOKED_FIELD] = [old]

    restarted = ServingReleases(tmp_path / "trust" / "releases.json")
    why = restarted.revoked(root, manifest.sha256)
    assert why is not None
    assert f"released under key {old[:16]}, revoked by fleet root version 2" in why
    assert restarted.revoked(root, "0" * 64) is None  # a configured model: taken with no release

    restarted.note(manifest.sha256, _release(manifest, keys))
    assert restarted.revoked(root, manifest.sha256) is None


def test_only_the_newest_models_are_kept(tmp_path: Path) -> None:
    keys = FleetKeys()
    kept = ServingReleases(tmp_path / "releases.json")
    manifests = [model_manifest(tmp_path, f"m{i}", size=64) for i in range(MAX_KEPT + 2)]
    for manifest in manifests:
        kept.note(manifest.sha256, _release(manifest, keys))
    root = keys.root(2)
    root.signed.unrecognized_fields[REVOKED_FIELD] = [keys.release.public_key.keyid]
    reread = ServingReleases(tmp_path / "releases.json")
    flagged = [reread.revoked(root, m.sha256) is not None for m in manifests]
    assert flagged == [False, False] + [True] * MAX_KEPT


def test_an_unreadable_file_costs_only_the_flags(tmp_path: Path) -> None:
    path = tmp_path / "releases.json"
    path.write_text("{not json")
    assert ServingReleases(path).revoked(FleetKeys().root(1), "0" * 64) is None
