"""Shared engines on the stick: ``fleet bundle`` carries the engine the controller's store holds for a
device's platform, ``edge-agent import`` keeps it, and an offline build takes it through the same
checks as one from the fleet. Real builders and ONNX Runtime engines (no TensorRT here), a real
controller desk and store reached in-process (tests/engines/fleet_desk.py), real bundle files."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from agent.config import AgentConfig, load_config
from agent.demo.modelzoo import write_classifier
from agent.engines.building.builder import EngineBuilder
from agent.engines.settings import EngineConfig
from agent.engines.sharing.cache import FLEET_BUILT_BY, FleetEngineCache
from agent.engines.sharing.imported import ImportedEngines
from agent.fleet.bundle.retained import Published
from agent.fleet.bundle.writer import engine_files, find_files, needed_files, shared_engines, write_bundle
from agent.fleet.deploy.keys import load_signing_key, write_keypair
from agent.fleet.engines.desk import EngineDesk
from agent.fleet.engines.local import LocalDeskRequests, local_download
from agent.lifecycle.bundle.importer import import_bundle
from agent.machine.platform import Platform, platform_summary
from agent.protocol.engines import SignedEngine
from agent.signing import load_public_key
from agent.trust.bundle import BundleError, blob_member
from tests.e2e.daemon import AgentFiles
from tests.engines.fleet_desk import make_desk
from tests.engines.sharing.test_cache import PLATFORM, SPEC
from tests.lifecycle.bundle.bundles import BundleTrust, members, rewrite
from tests.waiting import patient

DEVICE = "bundle-cam"
OTHER = "bundle-jetson"
#: Another platform: the same model's engine built there is not this device's.
OTHER_PLATFORM = dataclasses.replace(PLATFORM, machine="aarch64")


@dataclasses.dataclass
class Fleet:
    trust: BundleTrust
    desk: EngineDesk
    config: AgentConfig
    model: Path
    published: Published
    key: str


def info(platform: Platform) -> bytes:
    return json.dumps({"platform": platform_summary(platform)}).encode()


def builder(state_dir: Path, desk: EngineDesk, name: str, platform: Platform, trusted: Path) -> EngineBuilder:
    """A device's engine builder with its fleet level (and the imported engines it looks in first)."""
    made = EngineBuilder(state_dir, EngineConfig(build_timeout_s=patient(120)), platform)
    made.fleet = FleetEngineCache(
        LocalDeskRequests(desk, name),
        {"ops": load_public_key(trusted)},
        local_download(desk),
        work_dir=state_dir / "fleet-engines",
        ask_timeout_s=5.0,
        imported=ImportedEngines(state_dir),
    )
    return made


def built_and_stored(device: EngineBuilder, model: Path) -> str:
    with FleetEngineCache.sharing(True, "job-1", "cls", "2"):
        artifact = device.build(model, SPEC)
    assert device.fleet is not None
    outcome = device.fleet.offer(
        device.cache, artifact.key, job_id="job-1", shadow=True, probation_s=2.0, model=("cls", "2")
    )
    assert outcome == "stored"
    return artifact.key


@pytest.fixture
def fleet(tmp_path: Path) -> Fleet:
    trust = BundleTrust.init(tmp_path / "trust")
    ops = write_keypair(tmp_path / "ops", "ops")
    desk = make_desk(tmp_path / "controller" / "engines", load_signing_key(ops.private), "ops")
    model = write_classifier(tmp_path / "repo" / "classifier.onnx", input_size=32, num_classes=4)
    # Two builders of the same model on two platforms: the controller holds both engines.
    key = built_and_stored(builder(tmp_path / "dev-x86", desk, "dev-x86", PLATFORM, ops.public), model)
    built_and_stored(builder(tmp_path / "dev-arm", desk, "dev-arm", OTHER_PLATFORM, ops.public), model)
    assert len(desk.store.entries()) == 2
    files = AgentFiles(tmp_path / DEVICE, 1, DEVICE, frames=2)
    files.write_config(delivery={"trust_root": str(trust.anchor), "trusted_keys": {"ops": str(ops.public)}})
    config = load_config(files.config_path, require_models=False)
    desired = {
        d: {"cls": trust.desired(model, device=d, version="2", share_engines=True)[1]}
        for d in (DEVICE, OTHER)
    }
    published = Published(
        desired=desired,
        root_chain=trust.chain(),
        info={DEVICE: info(PLATFORM), OTHER: info(OTHER_PLATFORM)},
    )
    return Fleet(trust, desk, config, model, published, key)


def write(fleet: Fleet, out: Path, published: Published | None = None) -> Path:
    published = published or fleet.published
    files = find_files(needed_files(published), [fleet.model.parent])
    engines = shared_engines(published, fleet.desk.store)
    files.update(engine_files(engines, fleet.desk.store))
    key, key_id = fleet.trust.controller()
    write_bundle(out, published, files, key=key, key_id=key_id, engines=engines)
    return out


def test_the_bundle_carries_the_engine_for_each_devices_platform_and_not_another_platforms(
    fleet: Fleet, tmp_path: Path
) -> None:
    engines = shared_engines(fleet.published, fleet.desk.store)
    assert [e.record.key for e in engines[DEVICE]] == [fleet.key]
    assert [e.record.built_by for e in engines[OTHER]] == ["dev-arm"]
    assert engines[OTHER][0].record.key != fleet.key
    # A desired state that does not share engines, or a device that never reported its platform,
    # carries none.
    unshared = {DEVICE: {"cls": fleet.trust.desired(fleet.model, device=DEVICE, version="2")[1]}}
    assert shared_engines(Published(desired=unshared, info=fleet.published.info), fleet.desk.store) == {}
    silent = Published(desired={DEVICE: fleet.published.desired[DEVICE]})
    assert shared_engines(silent, fleet.desk.store) == {}

    bundle = write(fleet, tmp_path / "site.bundle")
    names = [name for name, _ in members(bundle)]
    engine_blobs = [blob_member(f.sha256) for d in (DEVICE, OTHER) for f in engines[d][0].record.files]
    assert set(engine_blobs) <= set(names)
    assert len(names) == len(set(names))  # each blob once


def test_an_imported_engine_is_taken_offline_without_a_build_or_an_ask(fleet: Fleet, tmp_path: Path) -> None:
    bundle = write(fleet, tmp_path / "site.bundle")
    report = import_bundle(bundle, fleet.config)
    assert report.engines == 1
    state = fleet.config.state_dir
    device = builder(state, fleet.desk, DEVICE, PLATFORM, Path(fleet.config.delivery.trusted_keys["ops"]))

    with FleetEngineCache.sharing(True, "bundle-job", "cls", "2"):
        artifact = device.build(fleet.model, SPEC)

    source = artifact.effective["engine_source"]
    assert (source["origin"], source["built_by"]) == ("downloaded", "dev-x86")
    assert artifact.key == fleet.key
    requests = device.fleet._requests  # type: ignore[union-attr]
    assert isinstance(requests, LocalDeskRequests)
    assert requests.verbs == []  # the controller was never asked
    entry = device.cache.get(fleet.key)
    assert entry is not None
    assert entry.meta.extra[FLEET_BUILT_BY] == "dev-x86"


def _state_files(state_dir: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(state_dir)): p.read_bytes() for p in sorted(state_dir.rglob("*")) if p.is_file()
    }


def test_a_tampered_engine_entry_is_refused_by_name_and_changes_nothing(fleet: Fleet, tmp_path: Path) -> None:
    state = fleet.config.state_dir
    state.mkdir(parents=True, exist_ok=True)
    before = _state_files(state)
    # Someone holding the controller key swaps the engine's record for one claiming another builder.
    engines = shared_engines(fleet.published, fleet.desk.store)
    signed = engines[DEVICE][0].signed
    altered = SignedEngine(
        record=signed.record.replace('"dev-x86"', '"dev-evil"'),
        key_id=signed.key_id,
        signature=signed.signature,
    )
    files = find_files(needed_files(fleet.published), [fleet.model.parent])
    files.update(engine_files(engines, fleet.desk.store))
    swapped = {**engines, DEVICE: [engines[DEVICE][0].model_copy(update={"signed": altered})]}
    key, key_id = fleet.trust.controller()
    forged = write_bundle(
        tmp_path / "forged.bundle", fleet.published, files, key=key, key_id=key_id, engines=swapped
    ).path
    with pytest.raises(
        BundleError, match=rf"engines\[{DEVICE}\]\[0\] is refused: .*signature does not match"
    ):
        import_bundle(forged, fleet.config)
    assert _state_files(state) == before

    # The engine's bytes altered on the stick: the signed index's SHA-256 refuses them.
    good = write(fleet, tmp_path / "good.bundle")
    engine_sha = engines[DEVICE][0].record.files[0].sha256
    damaged = rewrite(good, tmp_path / "damaged.bundle", {blob_member(engine_sha): b"not the engine"})
    with pytest.raises(BundleError, match=blob_member(engine_sha)):
        import_bundle(damaged, fleet.config)
    assert _state_files(state) == before


def test_an_imported_engine_whose_file_changed_on_the_device_is_refused_and_built_here(
    fleet: Fleet, tmp_path: Path
) -> None:
    import_bundle(write(fleet, tmp_path / "site.bundle"), fleet.config)
    state = fleet.config.state_dir
    kept = ImportedEngines(state)
    record = shared_engines(fleet.published, fleet.desk.store)[DEVICE][0].record
    engine = next(f for f in record.files if f.name == record.meta["engine_file"])
    stored = kept.files.path_for(engine.sha256)
    stored.chmod(0o644)
    stored.write_bytes(b"changed after the import")
    device = builder(state, fleet.desk, DEVICE, PLATFORM, Path(fleet.config.delivery.trusted_keys["ops"]))
    progress: list[str] = []

    with FleetEngineCache.sharing(True, "bundle-job", "cls", "2"):
        artifact = device.build(fleet.model, SPEC, progress=progress.append)

    assert artifact.effective["engine_source"]["origin"] == "built"
    assert any("imported engine" in line and "not the signed" in line for line in progress), progress
    assert device.fleet is not None
    assert device.fleet.refused(fleet.key) is not None
