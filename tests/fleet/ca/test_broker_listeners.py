"""configs/mosquitto/'s listeners with the real broker: a claim reaches only its own enrollment
topics, a claim is no device and a device no claim (each attack tried with a real mosquitto)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fleet.ca.broker_rig import CONNECTED, NOT_AUTHORIZED, EnrollmentBroker, accepted, try_connect
from tests.waiting import wait_until

PREFIX = "fleet/v1"


def enroll_topic(client_id: str, kind: str) -> str:
    return f"{PREFIX}/enroll/{client_id}/{kind}"


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnrollmentBroker]:
    running = EnrollmentBroker.start(tmp_path_factory.mktemp("enrollment-broker"))
    yield running
    running.stop()


def test_a_claim_publishes_its_own_request_and_nothing_else(broker: EnrollmentBroker) -> None:
    claim = broker.claim("batch-pub")
    me = "fleet:enroll:jet-new-1"
    operator = broker.operator()
    operator.subscribe(f"{PREFIX}/#")
    holder = broker.probe(broker.enroll_port, me, tls=claim)
    elsewhere = [
        enroll_topic("fleet:enroll:jet-other", "request"),  # another enrolling device's request
        enroll_topic(me, "reply"),  # forging its own reply
        f"{PREFIX}/jet-a/up/status",  # a device's topics
        f"{PREFIX}/jet-a/down/cmd/reboot",
        f"{PREFIX}/claim:batch-pub/up/status",  # its user name as a device id
        f"{PREFIX}/enroll/jet-a/request",
        "anything",
    ]
    for topic in elsewhere:
        assert holder.publish(topic, b"x") == NOT_AUTHORIZED, topic
    assert accepted(holder.publish(enroll_topic(me, "request"), b"mine"))
    # Messages of one client arrive in order: the request's arrival means nothing before it came.
    operator.wait_for_count(enroll_topic(me, "request"), 1)
    assert {m.topic for m in operator.snapshot()} == {enroll_topic(me, "request")}


def test_a_claim_subscribed_to_everything_reads_only_its_own_reply(broker: EnrollmentBroker) -> None:
    claim = broker.claim("batch-sub")
    me = "fleet:enroll:jet-new-2"
    holder = broker.probe(broker.enroll_port, me, tls=claim)
    for topic_filter in (
        "#",
        f"{PREFIX}/#",
        enroll_topic("fleet:enroll:jet-other", "reply"),
        f"{PREFIX}/+/down/#",
    ):
        holder.subscribe(topic_filter)  # mosquitto 2.0 checks READ on delivery, not the SUBSCRIBE
    operator = broker.operator()
    for topic in (
        enroll_topic("fleet:enroll:jet-other", "reply"),
        enroll_topic("fleet:enroll:jet-other", "request"),
        f"{PREFIX}/jet-a/down/cmd/status",
        f"{PREFIX}/jet-a/up/status",
    ):
        assert operator.publish(topic, b"not yours") == 0
    assert operator.publish(enroll_topic(me, "reply"), b"yours") == 0
    wait_until(lambda: bool(holder.on_topic(enroll_topic(me, "reply"))), what="the claim's own reply")
    assert {m.payload for m in holder.snapshot()} == {b"yours"}


def test_a_claim_is_refused_on_the_devices_and_operator_listeners(broker: EnrollmentBroker) -> None:
    claim = broker.claim("batch-wrong-door")
    refused_before = broker.handshakes_refused()
    assert try_connect(broker.host, broker.device_port, "fleet:jet-claimed", claim).startswith("tls refused")
    wait_until(lambda: broker.handshakes_refused() > refused_before, what="mosquitto refusing the claim")
    on_operators = try_connect(broker.host, broker.operator_port, "fleet:jet-claimed", claim)
    assert on_operators != CONNECTED
    assert "Not authorized" in on_operators


def test_a_claim_cannot_take_a_device_client_id(broker: EnrollmentBroker) -> None:
    device = broker.probe(broker.device_port, "fleet:jet-held", tls=broker.enroll("jet-held"))
    claim = broker.claim("batch-takeover")
    # The device's client id is its CN, jet-held: a claim may not send it (no "fleet:" prefix) ...
    assert "Not authorized" in try_connect(broker.host, broker.enroll_port, "jet-held", claim)
    # ... and "fleet:jet-held" is another client: the device keeps its connection.
    assert try_connect(broker.host, broker.enroll_port, "fleet:jet-held", claim) == CONNECTED
    assert accepted(device.publish(f"{PREFIX}/jet-held/up/status", b"still here"))
    assert (device.connects, device.disconnects) == (1, 0)


def test_a_device_certificate_is_refused_on_the_enrollment_listener(broker: EnrollmentBroker) -> None:
    tls = broker.enroll("jet-enrolled")
    refused_before = broker.handshakes_refused()
    refused = try_connect(broker.host, broker.enroll_port, "fleet:enroll:jet-enrolled", tls)
    assert refused.startswith("tls refused")
    wait_until(lambda: broker.handshakes_refused() > refused_before, what="mosquitto refusing the device")


def test_a_device_with_an_enroll_client_id_reaches_no_enrollment_topic(broker: EnrollmentBroker) -> None:
    tls = broker.enroll("jet-sly")
    assert "Not authorized" in try_connect(broker.host, broker.device_port, "enroll:jet-sly", tls)
    # With the prefix it connects, as jet-sly (its CN replaces the id): enrollment topics are not its.
    device = broker.probe(broker.device_port, "fleet:enroll:jet-sly", tls=tls)
    for topic in (enroll_topic("fleet:enroll:jet-sly", "request"), enroll_topic("jet-sly", "request")):
        assert device.publish(topic, b"x") == NOT_AUTHORIZED, topic
    assert accepted(device.publish(f"{PREFIX}/jet-sly/up/status", b"x"))


def test_the_documented_files_are_what_the_broker_ran(broker: EnrollmentBroker) -> None:
    ran = (broker.workdir / "mosquitto.conf").read_text()
    assert "per_listener_settings true" in ran
    assert f"crlfile {broker.ca.ca.crl}" in ran
    assert f"acl_file {broker.ca.ca.devices_acl}" in ran
    assert Path(broker.ca.ca.crl).is_file()


def test_without_the_enrollment_acl_a_claim_could_write_a_device_topic(tmp_path: Path) -> None:
    """What the enrollment listener's acl_file line protects against (per_listener_settings: no
    ACL on a listener means every topic for every client it admits)."""
    open_broker = EnrollmentBroker.start(tmp_path / "open", drop=("acl_file /etc/mosquitto/enrollment.acl",))
    try:
        holder = open_broker.probe(open_broker.enroll_port, "fleet:enroll:jet-x", tls=open_broker.claim("b"))
        assert accepted(holder.publish(f"{PREFIX}/jet-a/up/status", b"forged"))
    finally:
        open_broker.stop()
