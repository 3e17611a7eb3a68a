"""The enrollment messages and topics: client ids, the bytes a claim signs, the bounds."""

from __future__ import annotations

import pytest

from agent.protocol import topics
from agent.protocol.enrollment import (
    MAX_PEM_CHARS,
    CertRenewal,
    EnrollReply,
    EnrollRequest,
    device_of_enroll_client,
    enroll_client_id,
    signed_request_bytes,
)
from agent.protocol.messages import ProtocolError, decode, encode


def _request(**changes: object) -> EnrollRequest:
    fields: dict[str, object] = {
        "device_id": "cam-7",
        "request_id": "r1",
        "csr_pem": "-----BEGIN CERTIFICATE REQUEST-----\n...",
        "claim_cert_pem": "-----BEGIN CERTIFICATE-----\n...",
        "claim_signature": "ab" * 8,
        "msg_id": "m1",
        "ts": 1_800_000_000.0,
    }
    fields.update(changes)
    return EnrollRequest.model_validate(fields)


def test_an_enrollment_client_id_names_its_device_and_no_device_id_is_one() -> None:
    assert enroll_client_id("cam-7") == "enroll:cam-7"
    assert device_of_enroll_client("enroll:cam-7") == "cam-7"
    assert device_of_enroll_client("cam-7") is None
    assert device_of_enroll_client("enroll:") is None
    assert device_of_enroll_client("enroll:a:b") is None
    assert device_of_enroll_client("enroll:" + "x" * 65) is None
    # After the connecting client's mqtt.client_id_prefix (configs/mosquitto/: fleet:).
    assert enroll_client_id("cam-7", "fleet:") == "fleet:enroll:cam-7"
    assert device_of_enroll_client("fleet:enroll:cam-7") == "cam-7"
    assert device_of_enroll_client("fleet:enroll:a:b") is None
    assert device_of_enroll_client("a/b:enroll:cam-7") is None
    assert device_of_enroll_client("p" * 33 + "enroll:cam-7") is None


def test_the_signed_bytes_cover_every_field_but_the_signature() -> None:
    request = _request()
    again = _request(claim_signature="cd" * 8)
    assert request.signed_bytes() == again.signed_bytes()
    assert request.signed_bytes() != _request(csr_pem="other").signed_bytes()
    assert b"claim_signature" not in request.signed_bytes()
    assert request.signed_bytes() == signed_request_bytes(request.model_dump(mode="json"))


def test_a_request_survives_the_wire_and_its_signature_still_matches() -> None:
    request = _request(serial="SN-1")
    decoded = decode(EnrollRequest, encode(request))
    assert decoded == request
    assert decoded.signed_bytes() == request.signed_bytes()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("csr_pem", "x" * (MAX_PEM_CHARS + 1)),
        ("request_id", "a/b"),
        ("request_id", ""),
        ("claim_signature", "not hex"),
        ("device_id", "d" * 65),
        ("serial", "s" * 129),
    ],
)
def test_a_request_over_its_bounds_is_refused_naming_the_field(field: str, value: str) -> None:
    body = _request().model_dump(mode="json")
    body[field] = value
    with pytest.raises(ProtocolError, match=field):
        decode(EnrollRequest, EnrollRequest.model_construct(**body).model_dump_json().encode())


def test_a_reply_and_a_renewal_round_trip() -> None:
    reply = EnrollReply(request_id="r1", outcome="pending", code="pending_approval", retry_after_s=30.0)
    assert decode(EnrollReply, encode(reply)) == reply
    renewal = CertRenewal(request_id="r2", csr_pem="-----BEGIN CERTIFICATE REQUEST-----")
    assert decode(CertRenewal, encode(renewal)) == renewal


def test_enrollment_topics_sit_outside_every_device_tree_and_cert_topics_inside() -> None:
    request = topics.enroll_request("fleet/v1", "enroll:cam-7")
    assert request == "fleet/v1/enroll/enroll:cam-7/request"
    assert topics.enroll_reply("fleet/v1", "enroll:cam-7") == "fleet/v1/enroll/enroll:cam-7/reply"
    assert topics.enroll_client_of(request, "fleet/v1") == "enroll:cam-7"
    with pytest.raises(ValueError, match="not an enrollment request"):
        topics.enroll_client_of("fleet/v1/cam-7/up/cert", "fleet/v1")
    with pytest.raises(ValueError, match="one MQTT topic level"):
        topics.enroll_client_of("fleet/v1/enroll/a/b/request", "fleet/v1")
    device = topics.Topics("fleet/v1", "cam-7")
    assert topics.parse(device.cert_renewal) == topics.ParsedTopic("cam-7", "up", "cert", None)
    assert topics.parse(device.cert_reply) == topics.ParsedTopic("cam-7", "down", "cert", None)
    with pytest.raises(ValueError, match=r"too few levels|neither"):
        topics.parse(request)
