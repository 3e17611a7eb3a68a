"""The enrollment desk in a real controller process over a real mosquitto: registered devices are
issued at once, others wait for an operator (across a restart), rejected devices learn it, enrolled
devices renew; every reply says how long to wait before asking again."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from cryptography import x509

from agent.cli import main
from agent.demo.broker import Broker
from agent.fleet.ca.authority import DeviceAuthority
from agent.fleet.ca.pki import read_cert
from agent.protocol.enrollment import enroll_client_id
from tests.fleet.controller_process import ControllerProcess
from tests.fleet.enrollment.enroll_rig import (
    EnrollRig,
    csr_pem,
    database_lines,
    metric,
    new_key,
    running_rig,
    signed_request,
    start_rig,
)
from tests.postgres_server import PostgresServer


@pytest.fixture(params=["sqlite", "postgresql"])
def rig(request: pytest.FixtureRequest, tmp_path: Path, broker: Broker) -> Iterator[EnrollRig]:
    """The rig with the controller's store on SQLite (the book in its state dir) or PostgreSQL."""
    postgres = None if request.param == "sqlite" else request.getfixturevalue("postgres")
    yield from running_rig(tmp_path, broker, "min_renew_interval_s: 0", postgres=postgres)


def _issued_for(rig: EnrollRig, reply: dict[str, object], device_id: str) -> x509.Certificate:
    assert reply["outcome"] == "issued", reply
    cert = x509.load_pem_x509_certificate(str(reply["cert_pem"]).encode())
    chain = x509.load_pem_x509_certificate(str(reply["chain_pem"]).encode())
    assert cert.subject.rfc4514_string() == f"CN={device_id}"
    cert.verify_directly_issued_by(chain)
    chain.verify_directly_issued_by(read_cert(rig.ca.ca.root_cert))
    return cert


def test_a_registered_id_is_issued_at_once_and_a_repeated_request_gets_the_same_certificate(
    rig: EnrollRig,
) -> None:
    rig.operator("register", {"device_id": "cam-1"})
    request = signed_request("cam-1", rig.claim(), csr_pem(new_key(), "cam-1"))
    first = _issued_for(rig, rig.ask(request), "cam-1")
    rig.send("enroll:cam-1", request.model_dump_json().encode())  # the same request again (a lost reply)
    again = rig.reply("enroll:cam-1", request.request_id, nth=2)
    assert _issued_for(rig, again, "cam-1").serial_number == first.serial_number
    assert len(DeviceAuthority.load(rig.ca.ca.path).certificates_of("cam-1")) == 1
    enrolled = rig.operator("enrolled")["enrolled"]
    assert [(e["device_id"], e["serial"]) for e in enrolled] == [("cam-1", f"{first.serial_number:x}")]
    assert metric(rig.metrics(), 'edge_enroll_replies_total{outcome="issued"}') == 2
    assert metric(rig.metrics(), "edge_enroll_enrolled") == 1


def test_an_unknown_device_waits_until_accepted_and_a_replayed_acceptance_issues_nothing_more(
    rig: EnrollRig, capsys: pytest.CaptureFixture[str]
) -> None:
    key = new_key()
    request = signed_request("cam-2", rig.claim(), csr_pem(key, "cam-2"), serial="SN-2")
    waiting = rig.ask(request)
    assert (waiting["outcome"], waiting["code"]) == ("pending", "pending")
    assert waiting["retry_after_s"] == 60.0
    assert "fleet devices accept cam-2" in waiting["message"]
    broker_args = ["--broker", f"{rig.broker.host}:{rig.broker.port}", "--prefix", rig.prefix]
    assert main(["fleet", "devices", "pending", "--json", *broker_args]) == 0
    [listed] = json.loads(capsys.readouterr().out)["pending"]
    assert (listed["device_id"], listed["claim"], listed["serial"]) == ("cam-2", "batch-1", "SN-2")
    assert main(["fleet", "devices", "accept", "cam-2", *broker_args]) == 0
    assert "cam-2 accepted: certificate" in capsys.readouterr().out
    # The device's next look at its reply topic finds the certificate (sent at acceptance).
    issued = _issued_for(rig, rig.reply("enroll:cam-2", request.request_id, nth=2), "cam-2")
    replayed = rig.operator("accept", {"device_id": "cam-2"})
    assert replayed["already"] is True
    assert replayed["serial"] == f"{issued.serial_number:x}"
    assert len(DeviceAuthority.load(rig.ca.ca.path).certificates_of("cam-2")) == 1
    # Asking again with its key (it missed the reply): the same certificate.
    again = signed_request("cam-2", rig.claim(), csr_pem(key, "cam-2"), serial="SN-2")
    assert _issued_for(rig, rig.ask(again), "cam-2").serial_number == issued.serial_number
    assert rig.operator("pending")["pending"] == []


def test_a_pending_device_is_remembered_across_a_controller_killed_and_started_again(rig: EnrollRig) -> None:
    request = signed_request("cam-3", rig.claim(), csr_pem(new_key(), "cam-3"))
    assert rig.ask(request)["outcome"] == "pending"
    rig.controller.kill()
    rig.controller.start()
    assert [p["device_id"] for p in rig.operator("pending")["pending"]] == ["cam-3"]
    assert rig.operator("accept", {"device_id": "cam-3"})["already"] is False
    _issued_for(rig, rig.reply("enroll:cam-3", request.request_id, nth=2), "cam-3")


def test_a_rejected_device_is_told_so_with_a_long_wait_until_it_is_registered(rig: EnrollRig) -> None:
    key = new_key()
    assert rig.ask(signed_request("cam-4", rig.claim(), csr_pem(key, "cam-4")))["outcome"] == "pending"
    assert rig.operator("reject", {"device_id": "cam-4", "reason": "not ours"})["was_pending"] is True
    refused = rig.ask(signed_request("cam-4", rig.claim(), csr_pem(key, "cam-4")))
    assert (refused["outcome"], refused["code"], refused["retry_after_s"]) == ("rejected", "rejected", 3600.0)
    assert "not ours" in refused["message"]
    assert rig.operator("pending")["pending"] == []
    rig.operator("register", {"device_id": "cam-4"})
    _issued_for(rig, rig.ask(signed_request("cam-4", rig.claim(), csr_pem(key, "cam-4"))), "cam-4")


def test_an_enrolled_device_renews_over_up_cert_and_a_repeated_renewal_gets_the_same_certificate(
    rig: EnrollRig,
) -> None:
    rig.operator("register", {"device_id": "cam-5"})
    first = _issued_for(
        rig, rig.ask(signed_request("cam-5", rig.claim(), csr_pem(new_key(), "cam-5"))), "cam-5"
    )
    csr = csr_pem(new_key(), "cam-5")
    renewed = _issued_for(rig, rig.renew("cam-5", csr, request_id="renew-1"), "cam-5")
    assert renewed.serial_number != first.serial_number
    again = _issued_for(rig, rig.renew("cam-5", csr, request_id="renew-1", nth=2), "cam-5")
    assert again.serial_number == renewed.serial_number
    assert len(DeviceAuthority.load(rig.ca.ca.path).certificates_of("cam-5")) == 2
    stranger = rig.renew("cam-x", csr_pem(new_key(), "cam-x"))
    assert (stranger["outcome"], stranger["code"]) == ("refused", "not_enrolled")
    assert metric(rig.metrics(), 'edge_enroll_replies_total{outcome="renewed"}') == 1


def test_a_serial_in_the_registered_file_is_issued_at_once(tmp_path: Path, broker: Broker) -> None:
    registered = tmp_path / "registered.yaml"
    registered.write_text('devices:\n  - {serial: "SN-77"}\n  - {id: cam-8, serial: "SN-8"}\n')
    rig = start_rig(tmp_path, broker, f"registered_file: {registered}")
    try:
        _issued_for(
            rig,
            rig.ask(signed_request("cam-7", rig.claim(), csr_pem(new_key(), "cam-7"), serial="SN-77")),
            "cam-7",
        )
        _issued_for(
            rig,
            rig.ask(signed_request("cam-8", rig.claim(), csr_pem(new_key(), "cam-8"), serial="SN-8")),
            "cam-8",
        )
        unknown = rig.ask(signed_request("cam-9", rig.claim(), csr_pem(new_key(), "cam-9"), serial="SN-99"))
        assert unknown["outcome"] == "pending"
    finally:
        rig.probe.close()
        rig.controller.kill()


def test_a_device_enrolling_under_the_brokers_client_id_prefix_gets_the_acceptance_on_its_own_topic(
    rig: EnrollRig,
) -> None:
    client = enroll_client_id("cam-6", "fleet:")  # configs/mosquitto/ wants fleet: on every client id
    request = signed_request("cam-6", rig.claim(), csr_pem(new_key(), "cam-6"))
    assert rig.ask(request, client=client)["outcome"] == "pending"
    rig.operator("accept", {"device_id": "cam-6"})
    _issued_for(rig, rig.reply(client, request.request_id, nth=2), "cam-6")
    assert rig.replies("enroll:cam-6") == []


def test_a_controller_taking_over_on_another_host_knows_who_waits_and_who_is_enrolled(
    tmp_path: Path, broker: Broker, postgres: PostgresServer
) -> None:
    """Two controllers, each with a state dir of its own, one database: the second, started once the
    first was killed and its lease expired, lists the device that waits, answers a repeated request
    with the certificate the first issued (no second one) and counts the claim's uses the first
    spent. The CA directory is the same path for both here: on two hosts it is copied (docs/fleet.md)."""
    database = postgres.new_database()
    rig = start_rig(tmp_path, broker, postgres=postgres, database=database)
    second: ControllerProcess | None = None
    try:
        claim = rig.claim("pair", uses=2)
        rig.operator("register", {"device_id": "cam-a"})
        known = signed_request("cam-a", claim, csr_pem(new_key(), "cam-a"))
        first = _issued_for(rig, rig.ask(known), "cam-a")
        waiting = signed_request("cam-b", claim, csr_pem(new_key(), "cam-b"))
        assert rig.ask(waiting)["outcome"] == "pending"
        rig.controller.kill()
        with psycopg.connect(postgres.conninfo(database), autocommit=True) as pg:
            # What the killed holder's ttl running out leaves: a row the database says expired.
            pg.execute("UPDATE controller_lease SET expires_at = clock_timestamp() - interval '1 second'")
        (tmp_path / "two").mkdir()
        extra = f"enrollment: {{ca_dir: {rig.ca.ca.path}}}\n{database_lines(postgres, database)}"
        second = ControllerProcess(tmp_path / "two", broker, rig.prefix, extra=extra).start()
        rig.controller = second
        assert not (tmp_path / "two" / "state" / "enrollment.sqlite").exists()
        assert [p["device_id"] for p in rig.operator("pending")["pending"]] == ["cam-b"]
        rig.send("enroll:cam-a", known.model_dump_json().encode())  # its reply was lost: it asks again
        again = _issued_for(rig, rig.reply("enroll:cam-a", known.request_id, nth=2), "cam-a")
        assert again.serial_number == first.serial_number
        assert len(DeviceAuthority.load(rig.ca.ca.path).certificates_of("cam-a")) == 1
        assert rig.operator("accept", {"device_id": "cam-b"})["already"] is False  # the claim's 2nd use
        rig.operator("register", {"device_id": "cam-c"})
        spent = rig.ask(signed_request("cam-c", claim, csr_pem(new_key(), "cam-c")))
        assert (spent["outcome"], spent["code"]) == ("refused", "claim_used_up")
        assert "has enrolled 2 of its 2 devices" in spent["message"]
    finally:
        rig.probe.close()
        rig.controller.kill()
