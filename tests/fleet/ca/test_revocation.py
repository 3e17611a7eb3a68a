"""Revocation with the real mosquitto of configs/mosquitto/: ``fleet devices revoke`` and ``fleet
decommission`` cut the revoked device (connected or reconnecting) and leave every other device's
connection alone; an expired CRL refuses every device until it is re-issued."""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from agent.cli import main
from agent.fleet.ca.broker import tell_broker
from agent.fleet.ca.crl import read_crl
from agent.fleet.ca.pki import now, read_cert, read_key
from agent.fsutil import atomic_write_bytes
from tests.fleet.ca.broker_rig import (
    CONNECTED,
    NOT_AUTHORIZED,
    OPERATOR,
    CountingProbe,
    EnrollmentBroker,
    accepted,
    try_connect,
)
from tests.waiting import wait_until

PREFIX = "fleet/v1"


@pytest.fixture
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnrollmentBroker]:
    running = EnrollmentBroker.start(tmp_path_factory.mktemp("revocation-broker"))
    yield running
    running.stop()


def connected_device(broker: EnrollmentBroker, device_id: str) -> tuple[CountingProbe, dict[str, str]]:
    tls = broker.enroll(device_id)
    probe = broker.probe(broker.device_port, f"fleet:{device_id}", tls=tls)
    probe.subscribe(f"{PREFIX}/{device_id}/down/#")
    return probe, tls


def denied(probe: CountingProbe, device_id: str) -> bool:
    return probe.publish(f"{PREFIX}/{device_id}/up/status", b"x") == NOT_AUTHORIZED


def test_a_revoked_device_is_cut_at_once_and_refused_after_while_the_others_stay_connected(
    broker: EnrollmentBroker, capsys: pytest.CaptureFixture[str]
) -> None:
    jet_a, tls_a = connected_device(broker, "jet-a")
    others = {device: connected_device(broker, device)[0] for device in ("jet-b", "jet-c")}
    assert not denied(jet_a, "jet-a")
    capsys.readouterr()  # the set-up's log lines

    code = main(
        [
            "fleet",
            "devices",
            "revoke",
            "jet-a",
            "--reason",
            "stolen",
            "--ca-dir",
            str(broker.ca.ca.path),
            "--json",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["broker_told"] is True
    assert len(out["revoked"]) == 1
    crl = read_crl(broker.ca.ca.crl)
    assert crl is not None
    assert [f"{r.serial_number:x}" for r in crl] == out["revoked"]

    # Still connected (mosquitto does not re-check a live TLS session), but denied every topic.
    wait_until(lambda: denied(jet_a, "jet-a"), what="the revoked device's publishes refused")
    operator = broker.operator()
    assert operator.publish(f"{PREFIX}/jet-a/down/cmd/status", b"for a") == 0
    assert denied(jet_a, "jet-a")  # its PUBACK follows anything the broker sent it before
    assert jet_a.snapshot() == []
    refused_before = broker.handshakes_refused()
    assert try_connect(broker.host, broker.device_port, "fleet:jet-a", tls_a).startswith("tls refused")
    wait_until(lambda: broker.handshakes_refused() > refused_before, what="the CRL refusing jet-a")

    for device, probe in others.items():
        assert operator.publish(f"{PREFIX}/{device}/down/cmd/status", b"for " + device.encode()) == 0
        probe.wait_for_count(f"{PREFIX}/{device}/down/cmd/status", 1)
        assert not denied(probe, device)
        assert (probe.connects, probe.disconnects) == (1, 0), device


def test_decommission_with_the_ca_revokes_the_device(
    broker: EnrollmentBroker, capsys: pytest.CaptureFixture[str]
) -> None:
    jet_d, tls_d = connected_device(broker, "jet-d")
    jet_e, _ = connected_device(broker, "jet-e")
    assert accepted(jet_d.publish(f"{PREFIX}/jet-d/up/status", b'{"state":"online"}', retain=True))
    password_file = broker.workdir / "operator.pw"
    password_file.write_text(broker.operator_password)
    argv = [
        "fleet", "decommission", "jet-d", "--force", "--json", "--retained-wait", "2",
        "--ca-dir", str(broker.ca.ca.path),
        "--broker", f"{broker.host}:{broker.operator_port}", "--client-id-prefix", "fleet:",
        "--username", OPERATOR, "--password-file", str(password_file),
        "--tls-ca", str(broker.ca.ca.root_cert),
    ]  # fmt: skip
    capsys.readouterr()  # the set-up's log lines
    assert main(argv) == 0
    done = json.loads(capsys.readouterr().out)
    assert f"{PREFIX}/jet-d/up/status" in done["cleared"]
    assert len(done["revoked"]) == 1
    assert "told to reload" in done["broker"]
    wait_until(lambda: denied(jet_d, "jet-d"), what="the decommissioned device's publishes refused")
    assert try_connect(broker.host, broker.device_port, "fleet:jet-d", tls_d).startswith("tls refused")
    assert not denied(jet_e, "jet-e")
    assert (jet_e.connects, jet_e.disconnects) == (1, 0)


def test_a_device_enrolled_again_after_revocation_connects_with_its_new_certificate_only(
    broker: EnrollmentBroker,
) -> None:
    jet_f, old_tls = connected_device(broker, "jet-f")
    broker.authority().revoke_device("jet-f", "factory reset")
    wait_until(lambda: denied(jet_f, "jet-f"), what="the revoked device's publishes refused")
    new_tls = broker.enroll("jet-f")  # the desk issues a new certificate: its deny block goes
    wait_until(
        lambda: try_connect(broker.host, broker.device_port, "fleet:jet-f", new_tls) == CONNECTED,
        what="the new certificate accepted",
    )
    again = broker.probe(broker.device_port, "fleet:jet-f", tls=new_tls)
    wait_until(lambda: not denied(again, "jet-f"), what="the new certificate's publishes allowed")
    old = try_connect(broker.host, broker.device_port, "fleet:jet-f", old_tls)
    assert old.startswith("tls refused"), old


def test_an_expired_crl_refuses_every_device_until_it_is_renewed(
    broker: EnrollmentBroker, capsys: pytest.CaptureFixture[str]
) -> None:
    tls = broker.enroll("jet-g")
    assert try_connect(broker.host, broker.device_port, "fleet:jet-g", tls) == CONNECTED
    ca = broker.ca.ca
    issuer, key = read_cert(ca.devices_cert), read_key(ca.devices_key)
    expired = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(issuer.subject)
        .last_update(now() - datetime.timedelta(days=2))
        .next_update(now() - datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    atomic_write_bytes(ca.crl, expired.public_bytes(serialization.Encoding.PEM))
    assert tell_broker(ca).told  # not through DeviceAuthority.load(), which renews a due CRL
    wait_until(
        lambda: try_connect(broker.host, broker.device_port, "fleet:jet-g", tls).startswith("tls refused"),
        what="every device refused under an expired CRL",
    )
    capsys.readouterr()
    assert main(["fleet", "ca", "crl", "--ca-dir", str(ca.path)]) == 0
    assert "told to reload" in capsys.readouterr().out
    wait_until(
        lambda: try_connect(broker.host, broker.device_port, "fleet:jet-g", tls) == CONNECTED,
        what="devices accepted under the renewed CRL",
    )


def test_the_broker_reads_a_new_crl_only_when_told(broker: EnrollmentBroker) -> None:
    tls = broker.enroll("jet-h")
    authority = broker.authority()
    assert authority.revoke_device("jet-h", "test", tell=False)
    # The CRL on disk lists it, but mosquitto still holds the one it read: why every CRL write tells it.
    assert try_connect(broker.host, broker.device_port, "fleet:jet-h", tls) == CONNECTED
    assert authority.tell_broker().told
    wait_until(
        lambda: try_connect(broker.host, broker.device_port, "fleet:jet-h", tls).startswith("tls refused"),
        what="the CRL read after SIGHUP",
    )
