"""What a claim holder (or a device) sends that the enrollment desk must refuse, each against the real
controller process and a real mosquitto: every refusal names its code in one line and a wait, and
costs nothing (no certificate, no pending entry; the next good request is issued as before).

Not here: a topic with ``+`` or ``#`` (MQTT forbids them in a published topic: the broker drops the
client) and the claim used on other topics (refused by the enrollment listener's ACL: tests/fleet/ca).
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from agent.demo.broker import Broker
from agent.fleet.ca.authority import DeviceAuthority
from agent.fleet.ca.claims import ClaimBundle, read_claims
from agent.fleet.ca.pki import leaf_certificate, now, read_cert, read_key, write_cert, write_key
from agent.fleet.controller.client import RequestRefusedError
from agent.protocol.enrollment import EnrollRequest
from agent.protocol.messages import encode
from agent.protocol.topics import enroll_request
from tests.fleet.ca.ca_rig import make_ca
from tests.fleet.enrollment.enroll_rig import (
    EnrollRig,
    csr_pem,
    metric,
    new_key,
    running_rig,
    signed_request,
    start_rig,
    weak_rsa_key,
)
from tests.waiting import wait_until


@pytest.fixture
def rig(tmp_path: Path, broker: Broker) -> Iterator[EnrollRig]:
    yield from running_rig(tmp_path, broker)


def _refused(reply: dict[str, object], code: str) -> None:
    assert (reply["outcome"], reply["code"]) == ("refused", code), reply
    assert reply["retry_after_s"] == 600.0
    assert reply.get("cert_pem") is None
    assert "\n" not in str(reply["message"])
    assert 0 < len(str(reply["message"])) <= 300


def _still_serves(rig: EnrollRig, device_id: str) -> None:
    """Nothing was kept of the refusals, and a registered device is issued as before."""
    assert rig.operator("pending")["pending"] == []
    rig.operator("register", {"device_id": device_id})
    reply = rig.ask(signed_request(device_id, rig.claim(), csr_pem(new_key(), device_id)))
    assert reply["outcome"] == "issued", reply


def test_ids_with_slash_plus_hash_colon_empty_or_too_long_are_refused_bad_device_id(rig: EnrollRig) -> None:
    claim = rig.claim()
    for client in ("enroll:", "enroll:a:b", "enroll:" + "a" * 65, "enroll:.hidden"):
        rid = uuid.uuid4().hex[:12]
        rig.send(client, f'{{"request_id": "{rid}"}}'.encode())
        _refused(rig.reply(client, rid), "bad_device_id")
    # The client id names one device, the request another (any of / + # in it): the request's is refused.
    for other in ("cam/1", "cam+1", "cam#1", "cam:1"):
        request = signed_request(other, claim, csr_pem(new_key(), "cam-1"))
        _refused(rig.ask(request, client="enroll:cam-1"), "id_mismatch")
    # A CSR whose subject is no device id.
    for cn in ("a/b", "a+b", "#", "-x"):
        _refused(rig.ask(signed_request("cam-1", claim, csr_pem(new_key(), cn))), "bad_device_id")
    # The operator's side checks ids the same way.
    for bad in ("a/b", "a+b", "#", "", "a:b", "x" * 65):
        with pytest.raises(RequestRefusedError) as caught:
            rig.operator("accept", {"device_id": bad})
        assert caught.value.code == "bad_device_id"
    assert metric(rig.metrics(), 'edge_enroll_refused_total{code="bad_device_id"}') == 8
    _still_serves(rig, "cam-1")


def test_a_weak_an_unsupported_or_a_forged_key_and_a_broken_request_are_refused(rig: EnrollRig) -> None:
    claim = rig.claim()
    cases = {
        "weak_key": csr_pem(weak_rsa_key(), "cam-2"),
        "unsupported_key": csr_pem(ec.generate_private_key(ec.SECP521R1()), "cam-2"),
        "wrong_subject": csr_pem(new_key(), "cam-3"),
        "bad_csr": "-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n",
    }
    ed = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "cam-2")])
    )
    ed_csr = ed.sign(ed25519.Ed25519PrivateKey.generate(), None)
    cases["unsupported_key "] = ed_csr.public_bytes(serialization.Encoding.PEM).decode()
    for code, csr in cases.items():
        _refused(rig.ask(signed_request("cam-2", claim, csr)), code.strip())
    # A CSR whose signature does not match its key: its last signature byte changed.
    der = bytearray(
        x509.load_pem_x509_csr(csr_pem(new_key(), "cam-2").encode()).public_bytes(serialization.Encoding.DER)
    )
    der[-1] ^= 0x01
    forged = x509.load_der_x509_csr(bytes(der)).public_bytes(serialization.Encoding.PEM).decode()
    _refused(rig.ask(signed_request("cam-2", claim, forged)), "bad_signature")
    # Not an EnrollRequest at all, and one over the size read.
    for payload in (b"[1, 2]", b'{"request_id": "big", "pad": "' + b"x" * 70_000 + b'"}'):
        rig.send("enroll:cam-2", payload)
    rig.probe.wait_for(lambda _: sum(r["code"] == "bad_request" for r in rig.replies("enroll:cam-2")) == 2)
    assert metric(rig.metrics(), 'edge_enroll_refused_total{code="bad_request"}') == 2
    _still_serves(rig, "cam-2")


def test_a_request_for_another_devices_id_never_gets_its_certificate(rig: EnrollRig) -> None:
    claim = rig.claim()
    rig.operator("register", {"device_id": "cam-4"})
    owner = rig.ask(signed_request("cam-4", claim, csr_pem(new_key(), "cam-4")))
    old_serial = f"{x509.load_pem_x509_certificate(owner['cert_pem'].encode()).serial_number:x}"
    # Another key for the enrolled id (a thief with the claim, or the device after a factory reset).
    thief = rig.ask(signed_request("cam-4", claim, csr_pem(new_key(), "cam-4")))
    assert (thief["outcome"], thief["code"]) == ("pending", "already_enrolled")
    assert "--reenroll" in thief["message"]
    third = rig.ask(signed_request("cam-4", claim, csr_pem(new_key(), "cam-4")))
    assert third["code"] == "id_contested"
    with pytest.raises(RequestRefusedError) as caught:
        rig.operator("accept", {"device_id": "cam-4"})
    assert caught.value.code == "reenroll_needed"
    authority = DeviceAuthority.load(rig.ca.ca.path)
    assert len(authority.certificates_of("cam-4")) == 1
    # The operator decides: --reenroll revokes the old certificate and issues one for the new key.
    accepted = rig.operator("accept", {"device_id": "cam-4", "reenroll": True})
    assert accepted["revoked"] == [old_serial]
    records = DeviceAuthority.load(rig.ca.ca.path).certificates_of("cam-4")
    assert [(r.serial == old_serial, r.revoked_at is not None) for r in records] == [
        (True, True),
        (False, False),
    ]
    # A registered id with a serial: a request naming another serial (or none) is refused.
    rig.operator("register", {"device_id": "cam-5", "serial": "SN-5"})
    for serial in ("SN-6", None):
        _refused(
            rig.ask(signed_request("cam-5", claim, csr_pem(new_key(), "cam-5"), serial=serial)),
            "serial_mismatch",
        )
    assert DeviceAuthority.load(rig.ca.ca.path).certificates_of("cam-5") == []


def _forged_claim(rig: EnrollRig, name: str, not_after: datetime.datetime, *, other_ca: bool) -> ClaimBundle:
    """A claim certificate the CA's ledger does not list: expired, or made by another CA."""
    ca = make_ca(rig.tmp / "other").ca if other_ca else rig.ca.ca
    key = ec.generate_private_key(ec.SECP256R1())
    cert = leaf_certificate(
        f"claim:{name}", key.public_key(), read_key(ca.claims_key), read_cert(ca.claims_cert), not_after
    )
    folder = rig.tmp / "forged" / name
    folder.mkdir(parents=True)
    write_cert(folder / "claim.crt", cert)
    write_key(folder / "claim.key", key)
    name_listed = rig.claim().record.name  # any record: the ledger is not asked for a forged claim
    record = read_claims(rig.ca.ca.path)[name_listed]
    return ClaimBundle(folder / "claim.crt", folder / "claim.key", ca.root_cert, record)


def test_a_claim_used_past_its_count_expired_forged_or_not_signing_is_refused(rig: EnrollRig) -> None:
    small = rig.claim("batch-2", uses=2)
    for device in ("cam-6", "cam-7", "cam-8"):
        rig.operator("register", {"device_id": device})
    for device in ("cam-6", "cam-7"):
        assert rig.ask(signed_request(device, small, csr_pem(new_key(), device)))["outcome"] == "issued"
    _refused(rig.ask(signed_request("cam-8", small, csr_pem(new_key(), "cam-8"))), "claim_used_up")
    expired = _forged_claim(rig, "old", now() - datetime.timedelta(minutes=1), other_ca=False)
    _refused(rig.ask(signed_request("cam-9", expired, csr_pem(new_key(), "cam-9"))), "claim_expired")
    foreign = _forged_claim(rig, "foreign", now() + datetime.timedelta(days=1), other_ca=True)
    _refused(rig.ask(signed_request("cam-9", foreign, csr_pem(new_key(), "cam-9"))), "bad_claim")
    unlisted = _forged_claim(rig, "unlisted", now() + datetime.timedelta(days=1), other_ca=False)
    _refused(rig.ask(signed_request("cam-9", unlisted, csr_pem(new_key(), "cam-9"))), "bad_claim")
    # Signed, then changed: the device id swapped after the claim key signed.
    good = signed_request("cam-9", rig.claim(), csr_pem(new_key(), "cam-9"))
    tampered = EnrollRequest(**{**good.model_dump(), "serial": "SN-other"})
    _refused(rig.ask(tampered), "bad_claim_signature")
    assert DeviceAuthority.load(rig.ca.ca.path).certificates_of("cam-9") == []
    assert rig.operator("pending")["pending"] == []


def test_accepting_a_device_whose_claim_is_used_up_is_refused(rig: EnrollRig) -> None:
    one = rig.claim("batch-3", uses=1)
    assert rig.ask(signed_request("cam-10", one, csr_pem(new_key(), "cam-10")))["outcome"] == "pending"
    assert rig.ask(signed_request("cam-11", one, csr_pem(new_key(), "cam-11")))["outcome"] == "pending"
    assert rig.operator("accept", {"device_id": "cam-10"})["already"] is False
    with pytest.raises(RequestRefusedError) as caught:
        rig.operator("accept", {"device_id": "cam-11"})
    assert caught.value.code == "claim_used_up"
    assert [p["device_id"] for p in rig.operator("pending")["pending"]] == ["cam-11"]


def test_a_flood_of_ten_thousand_requests_from_one_claim_is_capped_counted_and_bounded(
    tmp_path: Path, broker: Broker
) -> None:
    rig = start_rig(tmp_path, broker, "max_pending_per_claim: 25")
    try:
        claim = rig.claim("flood", uses=1_000_000)
        csr_of = {}
        total, chunk = 10_000, 500
        sent = 0
        rss_before = None
        while sent < total:
            for n in range(sent, sent + chunk):
                device = f"flood-{n}"
                if device not in csr_of:
                    csr_of[device] = csr_pem(new_key(), device)
                rig.send(f"enroll:{device}", encode(signed_request(device, claim, csr_of[device])))
            sent += chunk

            def answered(count: int = sent) -> bool:
                text = rig.metrics()
                replies = sum(
                    metric(text, f'edge_enroll_replies_total{{outcome="{o}"}}')
                    for o in ("pending", "refused")
                )
                return replies + metric(text, "edge_enroll_dropped_total") >= count

            wait_until(answered, timeout=120, what=f"{sent} requests answered")
            if rss_before is None:
                rss_before = rig.controller.rss()
            csr_of.clear()
        text = rig.metrics()
        assert metric(text, "edge_enroll_pending") == 25
        assert metric(text, 'edge_enroll_replies_total{outcome="pending"}') == 25
        refused = metric(text, 'edge_enroll_refused_total{code="pending_full"}')
        assert refused + metric(text, "edge_enroll_dropped_total") == total - 25
        assert refused > 0
        assert len(rig.operator("pending")["pending"]) == 25
        # Memory and disk do not grow with the requests: 25 entries kept, nothing per refusal.
        assert rss_before is not None
        assert rig.controller.rss() - rss_before < 40 * 1024 * 1024
        state = tmp_path / "state"
        kept = sum(p.stat().st_size for p in state.glob("enrollment.sqlite*"))
        assert kept < 4 * 1024 * 1024, kept
        assert DeviceAuthority.load(rig.ca.ca.path).certificates_of("flood-0") == []
    finally:
        rig.probe.close()
        rig.controller.kill()


def test_a_device_enrolling_while_the_controller_is_down_is_issued_once_when_it_asks_again(
    rig: EnrollRig,
) -> None:
    rig.operator("register", {"device_id": "cam-12"})
    rig.controller.kill()
    request = signed_request("cam-12", rig.claim(), csr_pem(new_key(), "cam-12"))
    rig.send("enroll:cam-12", encode(request))  # nobody listens: the device's backoff asks again
    rig.controller.start()
    reply = rig.ask(request)
    assert reply["outcome"] == "issued"
    # The reply was lost too: the next ask (its backoff) gets the same certificate, not a second one.
    rig.controller.kill()
    rig.controller.start()
    again = rig.ask(signed_request("cam-12", rig.claim(), request.csr_pem))
    assert again["cert_pem"] == reply["cert_pem"]
    assert len(DeviceAuthority.load(rig.ca.ca.path).certificates_of("cam-12")) == 1


def test_a_revoked_device_asking_again_with_its_key_waits_for_the_operator(rig: EnrollRig) -> None:
    rig.operator("register", {"device_id": "cam-13"})
    key = new_key()
    first = rig.ask(signed_request("cam-13", rig.claim(), csr_pem(key, "cam-13")))
    assert first["outcome"] == "issued"
    DeviceAuthority.load(rig.ca.ca.path).revoke_device("cam-13", "stolen", tell=False)
    again = rig.ask(signed_request("cam-13", rig.claim(), csr_pem(key, "cam-13")))
    assert (again["outcome"], again["code"]) == ("pending", "revoked")
    assert again.get("cert_pem") is None
    with pytest.raises(RequestRefusedError) as caught:
        rig.operator("accept", {"device_id": "cam-13"})
    assert caught.value.code == "reenroll_needed"
    assert rig.operator("accept", {"device_id": "cam-13", "reenroll": True})["already"] is False
    records = DeviceAuthority.load(rig.ca.ca.path).certificates_of("cam-13")
    assert [r.revoked_at is not None for r in records] == [True, False]


def test_a_revoked_certificate_that_reaches_up_cert_is_not_renewed(rig: EnrollRig) -> None:
    # Under the documented broker a revoked certificate cannot publish at all; on one without the
    # CRL and the devices ACL it could, and a renewal must not undo the revocation.
    rig.operator("register", {"device_id": "cam-14"})
    key = new_key()
    assert rig.ask(signed_request("cam-14", rig.claim(), csr_pem(key, "cam-14")))["outcome"] == "issued"
    DeviceAuthority.load(rig.ca.ca.path).revoke_device("cam-14", "stolen", tell=False)

    reply = rig.renew("cam-14", csr_pem(new_key(), "cam-14"))

    assert (reply["outcome"], reply["code"]) == ("refused", "revoked")
    assert reply.get("cert_pem") is None
    records = DeviceAuthority.load(rig.ca.ca.path).certificates_of("cam-14")
    assert [r.revoked_at is not None for r in records] == [True]


def test_a_burst_past_the_desks_queue_is_dropped_and_counted(tmp_path: Path, broker: Broker) -> None:
    rig = start_rig(tmp_path, broker, "queue: 1")
    try:
        claim = rig.claim()
        payloads = [
            (
                f"enroll:burst-{n}",
                encode(signed_request(f"burst-{n}", claim, csr_pem(new_key(), f"burst-{n}"))),
            )
            for n in range(200)
        ]
        for client, payload in payloads:  # QoS 0: as fast as the broker takes them
            rig.probe.publish(enroll_request(rig.prefix, client), payload, qos=0)

        def counted() -> tuple[float, float]:
            text = rig.metrics()
            replies = sum(
                metric(text, f'edge_enroll_replies_total{{outcome="{o}"}}') for o in ("pending", "refused")
            )
            return replies, metric(text, "edge_enroll_dropped_total")

        wait_until(
            lambda: sum(counted()) == len(payloads), timeout=60, what="every request answered or dropped"
        )
        replies, dropped = counted()
        assert dropped > 0
        assert replies == len(rig.operator("pending")["pending"]) + metric(
            rig.metrics(), 'edge_enroll_refused_total{code="pending_full"}'
        )
    finally:
        rig.probe.close()
        rig.controller.kill()
