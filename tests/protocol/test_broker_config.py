"""docs/protocol.md's broker configuration, run as written, keeps each device to itself.

A real mosquitto started with the doc's config and ACL (tests/protocol/broker_doc.py), TLS client
certificates made in the test, the agent's real MqttLink on the devices, the real ChunkServer and
MqttPull for a model transfer, and a hijacker holding jet-a's certificate.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from structlog.testing import capture_logs

from agent.cli import main
from agent.config import read_yaml
from agent.delivery.transfer.partial import PartialDownload
from agent.delivery.transfer.pull import MqttPull
from agent.fleet.chunks.server import GROUP_PREFIX, ChunkServer
from agent.fleet.controller.config import ControllerConfig
from agent.fleet.controller.process import FleetController
from agent.mqtt.link import MqttLink
from agent.protocol.topics import Topics, trust_root
from agent.spool.queue import Spool
from agent.telemetry.loop import TelemetryLoop
from agent.telemetry.metrics import Metrics
from tests.delivery.transfer.transfer_rig import KIB, MIB, delivery_config, manifest_for, random_model
from tests.mqtt_probe import Probe
from tests.protocol.broker_doc import (
    DOC,
    OPERATOR,
    OPERATOR_PASSWORD,
    READER,
    READER_PASSWORD,
    DocBroker,
    doc_client_id_prefix,
)
from tests.waiting import patient, wait_until


@pytest.fixture
def doc_broker(tmp_path: Path) -> Iterator[DocBroker]:
    broker = DocBroker.start(tmp_path / "broker")
    yield broker
    broker.stop()


@pytest.fixture
def links(tmp_path: Path) -> Iterator[list[MqttLink]]:
    started: list[MqttLink] = []
    yield started
    for link in started:
        link.stop(timeout=1.0)


def device_link(broker: DocBroker, device: str, tmp_path: Path, links: list[MqttLink]) -> MqttLink:
    """The agent's link on ``device``, connected with its own certificate; stopped at teardown."""
    topics = Topics("fleet/v1", device)
    link = MqttLink(
        broker.device_settings(device),
        client_id=device,
        status_topic=topics.status,
        agent_version="0.0.test",
        spool=Spool(tmp_path / f"{device}.sqlite"),
    )
    links.append(link)
    link.start()
    assert link.wait_connected(10), f"{device} did not connect:\n{broker.log()}"
    return link


def operator_probe(broker: DocBroker) -> Probe:
    """A plain paho client on the operator listener (user name + password over TLS)."""
    return Probe(
        broker.host,
        broker.operator_port,
        client_id=broker.client_id(f"probe-{uuid.uuid4().hex[:8]}"),
        username=OPERATOR,
        password=OPERATOR_PASSWORD,
        tls={"ca_certs": str(broker.pki.ca_file)},
    )


def test_a_certificate_cannot_take_over_another_devices_connection_or_session(
    doc_broker: DocBroker, tmp_path: Path, links: list[MqttLink]
) -> None:
    jet_b = Topics("fleet/v1", "jet-b")
    commands: list[bytes] = []
    link_b = device_link(doc_broker, "jet-b", tmp_path, links)
    link_b.subscribe(jet_b.cmd_filter, lambda m: commands.append(m.payload))
    with Probe(
        doc_broker.host,
        doc_broker.device_port,
        client_id=doc_broker.client_id(
            "jet-b"
        ),  # jet-a's certificate, jet-b's client id, a persistent session
        tls=doc_broker.pki.probe_tls("jet-a"),
        session_expiry_s=3600,
    ) as hijacker:
        hijacker.subscribe(jet_b.cmd_filter)  # granted (subscriptions are not ACL-checked), never fed
        with operator_probe(doc_broker) as operator:
            assert operator.publish(jet_b.cmd("status"), b"for jet-b", qos=1) in (0x00, 0x10)
            wait_until(lambda: commands == [b"for jet-b"], what="jet-b's command reaches jet-b")
        hijacker.settle(0.5)
        assert hijacker.snapshot() == []
    # jet-b was never disconnected: mosquitto named the hijacker jet-a, not jet-b.
    assert link_b.connected
    assert link_b.stats()["reconnects"] == 0
    assert "Client jet-b already connected" not in doc_broker.log()
    assert "as jet-a (" in doc_broker.log()


@dataclass
class ConnAck:
    """What the broker answered a CONNECT."""

    refused: bool
    reason: str
    session_present: bool


def connect_as(broker: DocBroker, account: str, password: str, client_id: str) -> ConnAck:
    """Connect once on the operator listener with a persistent session; the CONNACK, then disconnect."""
    answered = threading.Event()
    acks: list[ConnAck] = []

    def on_connect(_c: Any, _u: Any, flags: Any, reason_code: Any, _p: Any) -> None:
        acks.append(ConnAck(reason_code.is_failure, str(reason_code), bool(flags.session_present)))
        answered.set()

    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    client.username_pw_set(account, password)
    client.tls_set(ca_certs=str(broker.pki.ca_file))
    client.on_connect = on_connect
    props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
    props.SessionExpiryInterval = 3600
    client.connect(broker.host, broker.operator_port, clean_start=False, properties=props)
    client.loop_start()
    try:
        assert answered.wait(patient(10)), f"no CONNACK for {account} as {client_id}"
    finally:
        client.disconnect()
        client.loop_stop()
    return acks[0]


@pytest.mark.parametrize(
    ("account", "password"),
    [(OPERATOR, OPERATOR_PASSWORD), (READER, READER_PASSWORD)],
    ids=[OPERATOR, READER],  # the passwords are made per process: never in a test's id
)
def test_no_operator_or_reader_account_can_use_a_devices_client_id(
    doc_broker: DocBroker, tmp_path: Path, links: list[MqttLink], account: str, password: str
) -> None:
    """Issue 19, point 11: on the operator listener the telegraf account took jet-b's session and
    closed the device's connection, every time it connected."""
    link_b = device_link(doc_broker, "jet-b", tmp_path, links)
    for _ in range(3):
        ack = connect_as(doc_broker, account, password, "jet-b")
        assert ack.refused, ack
        assert ack.reason == "Not authorized"
    # With the prefix it is a client of its own: no session of jet-b's, jet-b untouched.
    ack = connect_as(doc_broker, account, password, doc_broker.client_id("jet-b"))
    assert not ack.refused, ack
    assert not ack.session_present
    assert link_b.connected
    assert link_b.stats()["reconnects"] == 0
    assert "Client jet-b already connected" not in doc_broker.log()


def test_the_fleet_commands_reach_the_documented_broker_with_the_prefix_and_say_what_to_check_without(
    doc_broker: DocBroker, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = tmp_path / "operator.secret"
    secret.write_text(OPERATOR_PASSWORD)
    argv = [
        "fleet",
        "status",
        "--broker",
        f"{doc_broker.host}:{doc_broker.operator_port}",
        "--tls-ca",
        str(doc_broker.pki.ca_file),
        "--username",
        OPERATOR,
        "--password-file",
        str(secret),
        "--retained-wait",
        "0.2",
        "--telemetry-wait",
        "0",
    ]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "refused the connection (Not authorized)" in err
    assert "--client-id-prefix" in err
    # With the prefix it is let in: it reads the (empty) fleet, and says it found no device there.
    assert main([*argv, "--client-id-prefix", doc_client_id_prefix()]) == 1
    err = capsys.readouterr().err
    assert "refused" not in err
    assert "no devices found: nothing retained under fleet/v1/+/up/status" in err


def test_the_documented_operator_clients_send_the_prefix() -> None:
    """The controller's example config and operations.md's Telegraf recipe are clients of this broker."""
    prefix = doc_client_id_prefix()
    controller = ControllerConfig.model_validate(read_yaml(DOC.parents[1] / "configs" / "controller.yaml"))
    assert controller.mqtt.client_id_prefix == prefix
    telegraf = (DOC.parent / "operations.md").read_text()
    (client_id,) = re.findall(r'^\s*client_id = "([^"]*)"', telegraf, re.M)
    assert client_id.startswith(prefix)
    assert 'servers = ["ssl://broker.example.com:8884"]' in telegraf  # the operator listener


def test_without_clientid_prefixes_a_password_account_takes_a_devices_session(
    tmp_path: Path, links: list[MqttLink]
) -> None:
    """What the clientid_prefixes line protects against (the doc's configuration without it)."""
    broker = DocBroker.start(tmp_path / "broker", drop=(f"clientid_prefixes {doc_client_id_prefix()}",))
    try:
        link_b = device_link(broker, "jet-b", tmp_path, links)
        ack = connect_as(broker, READER, READER_PASSWORD, "jet-b")
        assert not ack.refused, ack
        assert ack.session_present  # jet-b's persistent session
        wait_until(lambda: "Client jet-b already connected" in broker.log(), what="jet-b's connection closed")
        wait_until(lambda: link_b.stats()["reconnects"] >= 1, what="jet-b reconnecting")
    finally:
        for link in links:
            link.stop(timeout=1.0)
        links.clear()
        broker.stop()


def test_a_device_joining_the_chunk_servers_group_loses_no_other_devices_chunk_request(
    doc_broker: DocBroker, tmp_path: Path, links: list[MqttLink]
) -> None:
    model = random_model(tmp_path / "repo" / "model.onnx", 2 * MIB + 123)
    manifest = manifest_for(model, 64 * KIB, device="jet-b")
    link_b = device_link(doc_broker, "jet-b", tmp_path, links)
    xfer = "fleet/v1/+/up/xfer/+"
    with (
        ChunkServer(doc_broker.operator_settings(tmp_path / "operator.secret")) as server,
        Probe(
            doc_broker.host,
            doc_broker.device_port,
            client_id=doc_broker.client_id("hijacker"),
            tls=doc_broker.pki.probe_tls("jet-a"),
        ) as hijacker,
    ):
        server.register(manifest, model)
        # Every group name a device can know: the documented prefix alone (the old default), the
        # deploy's job id (the old fleet deploy group). Mosquitto grants each subscription.
        for group in (GROUP_PREFIX, f"deploy-{manifest.job_id}", "deploy"):
            hijacker.subscribe(f"$share/{group}/{xfer}")
        partial = PartialDownload(tmp_path / "jet-b" / "partial", manifest, flush_every=2)
        pull = MqttPull(
            manifest,
            partial,
            link=link_b,
            topics=Topics("fleet/v1", "jet-b"),
            config=delivery_config(chunk_window=4, chunk_timeout_s=1.0, job_deadline_s=60.0),
        )
        pull.run()
        assert partial.finish().read_bytes() == model.read_bytes()
        # No request was handed to the hijacker (and lost there): none timed out, none asked twice.
        assert pull.stats.timeouts == 0
        assert pull.stats.requested_chunks == len(manifest.chunks)
        assert server.served_bytes("jet-b") == manifest.size
        assert hijacker.snapshot() == []


def every_name_in_the_docs() -> list[str]:
    """Every word of README.md and docs/*.md that can be a topic level, and the controller's old group.

    What a device could try as the chunk servers' group: whatever the documentation spells. The
    controller's group used to be a published constant (``edge-controller``), named here because the
    docs no longer spell it.
    """
    docs = [DOC.parents[1] / "README.md", *sorted(DOC.parent.glob("*.md"))]
    words = set(re.findall(r"[A-Za-z0-9][A-Za-z0-9_.-]*", "\n".join(p.read_text() for p in docs)))
    shared = set(re.findall(r"\$share/([^/`\s]+)/", "\n".join(p.read_text() for p in docs)))
    return sorted(words | shared | {"edge-controller", GROUP_PREFIX})


def test_a_device_trying_every_group_name_in_the_docs_loses_no_chunk_request_of_the_controller(
    doc_broker: DocBroker, tmp_path: Path, links: list[MqttLink]
) -> None:
    """Issue 19, point 3: the controller served under a published group; a device that joined it
    had the broker hand it a share of every device's chunk requests, and dropped them."""
    state = tmp_path / "controller"
    model = random_model(tmp_path / "repo" / "model.onnx", 2 * MIB + 123)
    manifest = manifest_for(model, 64 * KIB, device="jet-b")
    (state / "models").mkdir(parents=True)
    model.rename(state / "models" / f"{manifest.sha256}.onnx")
    config = ControllerConfig(
        mqtt=doc_broker.operator_settings(tmp_path / "operator.secret"), state_dir=state, unsigned=True
    )
    link_b = device_link(doc_broker, "jet-b", tmp_path, links)
    names = every_name_in_the_docs()
    assert {"edge-controller", "telegraf", "operator"} <= set(names)
    controller = FleetController(config).start()
    try:
        with Probe(
            doc_broker.host,
            doc_broker.device_port,
            client_id=doc_broker.client_id("hijacker"),
            tls=doc_broker.pki.probe_tls("jet-a"),
        ) as hijacker:
            # mosquitto grants every one of these (its ACL file never checks a SUBSCRIBE).
            granted = hijacker.subscribe_many([f"$share/{name}/fleet/v1/+/up/xfer/+" for name in names])
            assert granted == [1] * len(names)  # QoS 1 granted, each
            partial = PartialDownload(tmp_path / "jet-b" / "partial", manifest, flush_every=2)
            pull = MqttPull(
                manifest,
                partial,
                link=link_b,
                topics=Topics("fleet/v1", "jet-b"),
                config=delivery_config(chunk_window=4, chunk_timeout_s=1.0, job_deadline_s=60.0),
            )
            pull.run()
            assert (
                partial.finish().read_bytes() == (state / "models" / f"{manifest.sha256}.onnx").read_bytes()
            )
            # No request went to the hijacker's groups and got lost there: none timed out, none asked twice.
            assert pull.stats.timeouts == 0
            assert pull.stats.requested_chunks == len(manifest.chunks)
            assert controller.chunks.served_bytes("jet-b") == manifest.size
            assert hijacker.snapshot() == []
            assert controller.chunks.group not in names
    finally:
        controller.stop()


def test_publishing_outside_its_tree_is_refused_counted_logged_once_and_reported_in_telemetry(
    doc_broker: DocBroker, tmp_path: Path, links: list[MqttLink]
) -> None:
    link_a = device_link(doc_broker, "jet-a", tmp_path, links)
    jet_a, jet_b = Topics("fleet/v1", "jet-a"), Topics("fleet/v1", "jet-b")
    metrics = Metrics()
    metrics.add_collector(link_a.stats, prefix="mqtt")  # as agent/app/root.py does
    telemetry = TelemetryLoop(
        metrics,
        None,
        lambda m: link_a.publish(jet_a.telemetry, json.dumps(m).encode()),
        60.0,
        threading.Event(),
    )
    with operator_probe(doc_broker) as operator, capture_logs() as logs:
        operator.subscribe("fleet/v1/#")
        for i in range(40):  # durable results at frame rate, into another device's tree
            link_a.publish(jet_b.results("cam"), f'{{"frame": {i}}}'.encode(), durable=True)
        wait_until(lambda: link_a.stats()["acl_denied"] == 40, what="40 refusals counted")
        denied = [e for e in logs if e["event"] == "mqtt.publish.denied"]
        assert len(denied) == 1, denied
        assert operator.on_topic(jet_b.results("cam")) == []
        # The device's own tree is still open to it: the counter reaches the operator.
        assert telemetry.tick()
        (message,) = operator.wait_for_count(jet_a.telemetry, 1)
        assert json.loads(message.payload)["mqtt.acl_denied"] == 40
        # An accepted publish ends the episode; the next refusal is logged again.
        link_a.publish(jet_a.jobs("j1"), b"{}", durable=True)
        operator.wait_for_count(jet_a.jobs("j1"), 1)
        wait_until(lambda: any(e["event"] == "mqtt.publish.denied.ended" for e in logs), what="episode end")
        link_a.publish(jet_b.results("cam"), b"{}", durable=True)
        wait_until(lambda: link_a.stats()["acl_denied"] == 41, what="41st refusal")
        assert [e["event"] for e in logs].count("mqtt.publish.denied") == 2


def test_every_device_reads_the_fleet_root_and_none_can_publish_one(
    doc_broker: DocBroker, tmp_path: Path, links: list[MqttLink]
) -> None:
    """A compromised device cannot offer its own root to the fleet: the documented ACL lets a device
    read ``_trust/root`` and write nothing there (its publish is refused, the retained root stays)."""
    topic = trust_root("fleet/v1")
    roots: list[bytes] = []
    link = device_link(doc_broker, "jet-a", tmp_path, links)
    link.subscribe(topic, lambda m: roots.append(m.payload))
    with operator_probe(doc_broker) as operator:
        assert operator.publish(topic, b'{"roots": [{}]}', qos=1, retain=True) in (0x00, 0x10)
        wait_until(lambda: roots == [b'{"roots": [{}]}'], what="jet-a receives the operator's root chain")
        with Probe(
            doc_broker.host,
            doc_broker.device_port,
            client_id=doc_broker.client_id("jet-b"),
            tls=doc_broker.pki.probe_tls("jet-b"),
        ) as thief:
            assert thief.publish(topic, b'{"roots": [{"forged": true}]}', qos=1, retain=True) == 0x87
        operator.subscribe(topic)
        [kept] = operator.wait_for_count(topic, 1)
        assert kept.payload == b'{"roots": [{}]}'
        operator.publish(topic, b"", qos=1, retain=True)
