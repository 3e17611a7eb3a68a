"""``edge-agent fleet trust ...`` through the real parser: the offline steps on files, then the chain
published retained to a real broker, taken by a device's own rules."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest

from agent.cli import main
from agent.demo.broker import Broker
from agent.demo.modelzoo import write_classifier
from agent.fleet.cli.deploy import postprocess_from_args
from agent.fleet.trust.keyring import key_id_of
from agent.protocol.manifest import build_manifest
from agent.protocol.messages import RootChain
from agent.protocol.topics import trust_root
from agent.signing import load_public_key
from agent.trust.anchor import adopted_root
from agent.trust.release import check_release
from agent.trust.root import newest_root, read_root
from tests.fleet.operator_side import unique_prefix
from tests.mqtt_probe import Probe


def test_init_revoke_sign_and_publish_reach_a_device_as_a_chain_it_takes(
    broker: Broker, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trust = tmp_path / "trust"
    d = ["--dir", str(trust)]
    assert main(["fleet", "trust", "init", *d, "--root-keys", "2", "--threshold", "2"]) == 0
    assert "trust_root:" in capsys.readouterr().out
    keys = trust / "keys"
    assert main(["fleet", "keygen", "--out", str(keys), "--key-id", "controller-2"]) == 0
    assert (
        main(
            ["fleet", "trust", "rotate", *d, "--role", "controller", "--add", str(keys / "controller-2.pub")]
        )
        == 0
    )
    for n in (1, 2):
        assert main(["fleet", "trust", "sign", *d, "--key", str(keys / f"root-{n}.key")]) == 0
    stolen = key_id_of(keys / "controller.pub")
    assert main(["fleet", "trust", "revoke", *d, stolen]) == 0
    # Half-signed: publishing is refused before anything reaches the broker.
    assert main(["fleet", "trust", "sign", *d, "--key", str(keys / "root-1.key")]) == 0
    prefix = unique_prefix()
    publish = [
        "fleet",
        "trust",
        "publish",
        *d,
        "--broker",
        f"{broker.host}:{broker.port}",
        "--prefix",
        prefix,
    ]
    assert main(publish) == 1
    assert main(["fleet", "trust", "sign", *d, "--key", str(keys / "root-2.key")]) == 0
    capsys.readouterr()
    assert main(["fleet", "trust", "show", *d, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["signed"]["version"] == 3
    assert shown["signed"]["x-edge-revoked"] == [stolen]
    assert main(publish) == 0
    with Probe(broker.host, broker.port) as probe:
        probe.subscribe(trust_root(prefix))
        [message] = probe.wait_for_count(trust_root(prefix), 1)
    assert message.retain
    chain = RootChain.model_validate_json(message.payload)
    roots = [read_root(json.dumps(r).encode()) for r in chain.roots]
    root, refused = newest_root(roots[0], roots)
    assert (root.signed.version, refused) == (3, [])


def test_release_binds_the_model_and_its_labels_as_deployed(tmp_path: Path) -> None:
    trust = tmp_path / "trust"
    assert main(["fleet", "trust", "init", "--dir", str(trust), "--root-keys", "1", "--threshold", "1"]) == 0
    model = write_classifier(tmp_path / "m.onnx", input_size=64, seed=1)
    labels = tmp_path / "labels.txt"
    labels.write_text("\n".join(f"c{i}" for i in range(10)))
    out = tmp_path / "m.release.json"
    argv = ["fleet", "trust", "release", str(model), "--key", str(trust / "keys" / "release.key")]
    argv += ["--out", str(out), "--model-id", "cls", "--version", "7", "--labels", str(labels)]
    assert main(argv) == 0
    root = read_root((trust / "root" / "1.root.json").read_bytes())
    manifest = build_manifest(
        model,
        job_id="j",
        sequence=1,
        slot="main",
        model_id="cls",
        version="7",
        postprocess=postprocess_from_args(None, labels),
    )
    check_release(root, out.read_text(), manifest, datetime.now(timezone.utc))


def test_publish_with_an_adopt_key_vouches_for_the_root_to_devices_that_trust_that_key(
    broker: Broker, tmp_path: Path
) -> None:
    trust = tmp_path / "trust"
    assert main(["fleet", "trust", "init", "--dir", str(trust), "--root-keys", "1", "--threshold", "1"]) == 0
    assert main(["fleet", "keygen", "--out", str(tmp_path / "old"), "--key-id", "fleet-old"]) == 0
    prefix = unique_prefix()
    publish = ["fleet", "trust", "publish", "--dir", str(trust), "--broker", f"{broker.host}:{broker.port}"]
    publish += ["--prefix", prefix, "--adopt-key", str(tmp_path / "old" / "fleet-old.key")]
    assert main(publish) == 1  # no --adopt-key-id
    assert main([*publish, "--adopt-key-id", "fleet-old"]) == 0
    with Probe(broker.host, broker.port) as probe:
        probe.subscribe(trust_root(prefix))
        [message] = probe.wait_for_count(trust_root(prefix), 1)
    trusted = {"fleet-old": load_public_key(tmp_path / "old" / "fleet-old.pub")}
    adopted = adopted_root(message.payload, trusted, tmp_path / "device" / "root.json")
    assert adopted is not None
    assert adopted.current().signed.version == 1
    assert (
        adopted_root(
            message.payload, {"fleet-old": load_public_key(trust / "keys" / "release.pub")}, tmp_path / "x"
        )
        is None
    )
