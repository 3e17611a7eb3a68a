"""A device with a fleet root, over a real broker: a stolen controller key cannot ship a model nobody
released, a revoked key is refused once the new root arrived over MQTT, an expired root installs nothing.

The device is the in-process delivery stack (real MqttLink, spool, store, DeliveryService, real
mosquitto); its slot is the recording stand-in of tests/delivery/delivery_stack.py, so no shadow or
probation runs here: a refusal happens at the gate, before any model reaches a slot.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from agent.demo.modelzoo import write_classifier
from agent.fleet.deploy.keys import KeyPairFiles
from agent.fleet.trust import versions
from agent.fleet.trust.keyring import key_id_of, make_key
from agent.fleet.trust.publish import adoption
from agent.fleet.trust.releases import sign_release
from agent.fleet.trust.versions import TrustDir
from agent.protocol.manifest import DeployManifest, sign_manifest
from agent.protocol.messages import JobState
from agent.protocol.topics import trust_root
from agent.signing import generate_keypair, load_private_key, private_key_from_bytes
from tests.delivery.conftest import HarnessFactory
from tests.delivery.delivery_stack import HAPPY_PATH, KEY_ID, Harness, states
from tests.waiting import wait_until

# One retained _trust/root topic on the shared broker: these tests run one after another.
pytestmark = pytest.mark.xdist_group("fleet_root")


def _desired(manifest: DeployManifest, key: Path, release: Path | None) -> bytes:
    text = release.read_text() if release is not None else None
    return sign_manifest(manifest, load_private_key(key), key_id_of(key), release=text)


def _released(manifest: DeployManifest, keys: list[Path], tmp_path: Path) -> Path:
    return sign_release(
        manifest, keys, tmp_path / f"{manifest.job_id}.release.json", version=1, expires_days=30
    )


def _refused(device: Harness, manifest: DeployManifest, payload: bytes) -> str | None:
    device.deploy(payload)
    [status] = device.wait_terminal(manifest.job_id)
    assert status.state is JobState.REJECTED
    return status.error_code


def _replace_key(fleet: Path, role: str) -> KeyPairFiles:
    """Root version 2 adds a new ``role`` key, version 3 revokes the old one; each signed offline by
    two root keys of itself and of the version before (the same keys), as `fleet trust sign` does."""
    keys = fleet / "keys"
    new = make_key(keys, f"{role}-2")
    versions.rotate(fleet, role=role, add=[new.public], remove=[], threshold=None, expires_days=365)
    versions.sign(fleet, keys / "root-1.key")
    versions.sign(fleet, keys / "root-2.key")
    versions.revoke(fleet, key_id_of(keys / f"{role}.pub"), expires_days=365)
    versions.sign(fleet, keys / "root-2.key")
    versions.sign(fleet, keys / "root-3.key")
    return new


@contextmanager
def _root_taken(device: Harness, fleet: Path) -> Iterator[None]:
    """The fleet's root chain published retained, until the device took its newest version; cleared after."""
    fleet_root = device.service.fleet_root
    assert fleet_root is not None
    newest = TrustDir(fleet).versions()[-1]
    topic = trust_root("fleet/v1")
    device.probe.publish(topic, TrustDir(fleet).chain().model_dump_json().encode(), retain=True)
    try:
        wait_until(
            lambda: fleet_root.current().signed.version == newest, 15.0, f"the device to take root {newest}"
        )
        yield
    finally:
        device.probe.publish(topic, b"", retain=True)


@pytest.fixture
def fleet(tmp_path: Path) -> Path:
    trust = tmp_path / "trust"
    versions.init(trust, root_keys=3, threshold=2, expires_days=365)
    return trust


def test_a_stolen_controller_key_cannot_ship_unreleased_bytes_and_released_ones_still_deploy(
    make_device: HarnessFactory, fleet: Path, tmp_path: Path
) -> None:
    keys = fleet / "keys"
    device = make_device(config={"trust_root": fleet / "root" / "1.root.json"})
    good = write_classifier(tmp_path / "good.onnx", input_size=64, seed=1)
    manifest = device.manifest(good, sequence=1)
    device.deploy(
        _desired(manifest, keys / "controller.key", _released(manifest, [keys / "release.key"], tmp_path))
    )
    assert states(device.wait_terminal(manifest.job_id)) == HAPPY_PATH
    # The thief holds controller.key: a new model, with no release, and with one it signed itself.
    evil = write_classifier(tmp_path / "evil.onnx", input_size=64, seed=7)
    bare = device.manifest(evil, sequence=2)
    assert _refused(device, bare, _desired(bare, keys / "controller.key", None)) == "unreleased"
    forged = device.manifest(evil, sequence=3)
    self_signed = _released(forged, [keys / "controller.key"], tmp_path)
    assert _refused(device, forged, _desired(forged, keys / "controller.key", self_signed)) == "unreleased"
    assert [r.sha256 for r in device.activations.requests] == [manifest.sha256]
    # Rollouts among released models keep working.
    second = write_classifier(tmp_path / "second.onnx", input_size=64, seed=2)
    again = device.manifest(second, sequence=4)
    device.deploy(
        _desired(again, keys / "controller.key", _released(again, [keys / "release.key"], tmp_path))
    )
    assert states(device.wait_terminal(again.job_id)) == HAPPY_PATH


def test_a_revoked_controller_key_is_refused_once_the_new_root_arrives_over_mqtt(
    make_device: HarnessFactory, fleet: Path, tmp_path: Path
) -> None:
    keys = fleet / "keys"
    device = make_device(config={"trust_root": fleet / "root" / "1.root.json"})
    new = _replace_key(fleet, "controller")
    with _root_taken(device, fleet):
        model = write_classifier(tmp_path / "m.onnx", input_size=64, seed=3)
        stale = device.manifest(model, sequence=1)
        release = _released(stale, [keys / "release.key"], tmp_path)
        assert _refused(device, stale, _desired(stale, keys / "controller.key", release)) == "revoked_key"
        fresh = device.manifest(model, sequence=2)
        release = _released(fresh, [keys / "release.key"], tmp_path)
        device.deploy(_desired(fresh, new.private, release))
        assert states(device.wait_terminal(fresh.job_id)) == HAPPY_PATH
        # The taken root survives a restart (a replayed old root: tests/trust/test_root.py).
        assert (device.state_dir / "trust" / "root.json").is_file()
    device.stop()
    restarted = make_device(state_dir=device.state_dir, config={"trust_root": fleet / "root" / "1.root.json"})
    assert restarted.service.fleet_root is not None
    assert restarted.service.fleet_root.current().signed.version == 3


def test_an_expired_root_installs_nothing_new(make_device: HarnessFactory, tmp_path: Path) -> None:
    trust = tmp_path / "old-trust"
    versions.init(trust, root_keys=1, threshold=1, expires_days=-1)
    device = make_device(config={"trust_root": trust / "root" / "1.root.json"})
    model = write_classifier(tmp_path / "m.onnx", input_size=64, seed=4)
    manifest = device.manifest(model, sequence=1)
    release = _released(manifest, [trust / "keys" / "release.key"], tmp_path)
    payload = _desired(manifest, trust / "keys" / "controller.key", release)
    assert _refused(device, manifest, payload) == "trust_expired"
    assert device.activations.requests == []


def test_a_model_released_under_a_key_revoked_later_keeps_serving_and_is_not_released_again(
    make_device: HarnessFactory, fleet: Path, tmp_path: Path
) -> None:
    keys = fleet / "keys"
    device = make_device(config={"trust_root": fleet / "root" / "1.root.json"})
    model = write_classifier(tmp_path / "m.onnx", input_size=64, seed=5)
    serving = device.manifest(model, sequence=1)
    old_release = _released(serving, [keys / "release.key"], tmp_path)
    device.deploy(_desired(serving, keys / "controller.key", old_release))
    assert states(device.wait_terminal(serving.job_id)) == HAPPY_PATH
    new = _replace_key(fleet, "release")
    with _root_taken(device, fleet):
        # The serving model is neither rolled back nor re-checked; its release deployed again is refused.
        again = device.manifest(model, sequence=2)
        stale = _desired(again, keys / "controller.key", _released(again, [keys / "release.key"], tmp_path))
        assert _refused(device, again, stale) == "revoked_key"
        assert device.rollbacks == []
        assert [r.sha256 for r in device.activations.requests] == [serving.sha256]
        renewed = device.manifest(model, sequence=3)
        device.deploy(_desired(renewed, keys / "controller.key", _released(renewed, [new.private], tmp_path)))
        assert states(device.wait_terminal(renewed.job_id)) == HAPPY_PATH


def test_a_device_with_trusted_keys_adopts_the_root_its_key_vouches_for_and_then_needs_releases(
    make_device: HarnessFactory, fleet: Path, tmp_path: Path
) -> None:
    keys = fleet / "keys"
    device = make_device()  # delivery.trusted_keys only, as every device before a fleet root
    model = write_classifier(tmp_path / "m.onnx", input_size=64, seed=6)
    old_style = device.manifest(model, sequence=1)
    device.deploy(device.signed(old_style))
    assert states(device.wait_terminal(old_style.job_id)) == HAPPY_PATH
    topic = trust_root("fleet/v1")
    chain = TrustDir(fleet).chain()
    try:
        # Vouched for by a key the device does not trust: ignored, old manifests keep working.
        stranger = private_key_from_bytes(generate_keypair()[0])
        device.probe.publish(topic, adoption(chain, stranger, KEY_ID).model_dump_json().encode(), retain=True)
        still = device.manifest(model, sequence=2)
        device.deploy(device.signed(still))
        assert states(device.wait_terminal(still.job_id)) == HAPPY_PATH
        assert device.service.fleet_root is None
        # Vouched for by its own trusted key: adopted, kept, and from then on releases are required.
        device.probe.publish(
            topic, adoption(chain, device.keys.private, KEY_ID).model_dump_json().encode(), retain=True
        )
        wait_until(lambda: device.service.fleet_root is not None, 15.0, "the device to adopt the root")
        unreleased = device.manifest(model, sequence=3)
        assert _refused(device, unreleased, device.signed(unreleased)) == "unknown_key"
        released = device.manifest(model, sequence=4)
        device.deploy(
            _desired(released, keys / "controller.key", _released(released, [keys / "release.key"], tmp_path))
        )
        assert states(device.wait_terminal(released.job_id)) == HAPPY_PATH
    finally:
        device.probe.publish(topic, b"", retain=True)
    device.stop()
    restarted = make_device(state_dir=device.state_dir)
    assert restarted.service.fleet_root is not None
