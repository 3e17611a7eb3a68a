"""Enrollment by claim against a real mosquitto (enrollment and devices listeners, the real fleet CA).

The controller's side is :class:`~tests.enrollment.fleet_pki.StandInDesk`: the real CA API answering
in place of the admission desk, scripted per test (pending, refused, silent, replayed).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from agent.enrollment.claim_session import ClaimEnrollment
from agent.enrollment.keys import CertificateFacts, is_for_key, load_key, load_or_make_key
from agent.mqtt.service_client import ServiceClient
from agent.protocol.enrollment import CertRenewal, EnrollReply, EnrollRequest
from agent.protocol.topics import Topics, enroll_reply
from tests.enrollment.fleet_pki import PREFIX, FleetPki, StandInDesk
from tests.mqtt_probe import Probe
from tests.waiting import patient

Request = EnrollRequest | CertRenewal


def _enroll(
    pki: FleetPki, device_dir: Path, device_id: str, stop: threading.Event | None = None, **settings: object
) -> tuple[ClaimEnrollment, threading.Thread, list[CertificateFacts | None]]:
    """Enrollment running in a thread; its result lands in the returned list."""
    enrollment = ClaimEnrollment(
        device_id, pki.device_mqtt(device_dir), pki.enrollment(**settings), stop=stop or threading.Event()
    )
    result: list[CertificateFacts | None] = []
    thread = threading.Thread(target=lambda: result.append(enrollment.run()), daemon=True)
    thread.start()
    return enrollment, thread, result


def _finished(thread: threading.Thread, result: list[CertificateFacts | None]) -> CertificateFacts:
    thread.join(patient(30))
    assert not thread.is_alive(), "enrollment did not finish"
    assert result
    assert result[0] is not None
    return result[0]


def _gaps(desk: StandInDesk) -> list[float]:
    times = [asked.at for asked in desk.requests()]
    return [b - a for a, b in itertools.pairwise(times)]


def test_a_device_with_only_a_claim_gets_its_own_certificate_and_connects_with_it(
    fleet_pki: FleetPki, desk: StandInDesk, tmp_path: Path
) -> None:
    device_dir = tmp_path / "dev"
    _, thread, result = _enroll(fleet_pki, device_dir, "jet-1")
    facts = _finished(thread, result)

    key_file, cert_file = device_dir / "device.key", device_dir / "device.crt"
    assert key_file.stat().st_mode & 0o777 == 0o600
    cert = x509.load_pem_x509_certificates(cert_file.read_bytes())
    assert facts.subject == "jet-1"
    assert is_for_key(cert[0], load_key(key_file))
    assert len(cert) == 2  # the leaf and the devices intermediate: what TLS presents
    assert fleet_pki.authority.certificates_of("jet-1")[0].serial == facts.serial
    request = desk.requests()[0].request
    assert isinstance(request, EnrollRequest)
    assert "PRIVATE KEY" not in request.model_dump_json()  # the key never left the device

    # An ordinary device from here on: its own certificate on the devices listener, its own tree.
    probe = Probe(fleet_pki.broker.host, fleet_pki.broker.port)
    probe.subscribe(f"{PREFIX}/jet-1/up/#")
    device = ServiceClient(fleet_pki.device_mqtt(device_dir), client_id="jet-1").start()
    try:
        device.publish(Topics(PREFIX, "jet-1").status, b'{"state":"online"}', qos=1)
        probe.wait_for(lambda msgs: any(m.topic.endswith("/up/status") for m in msgs))
    finally:
        device.stop()
        probe.close()


def _pending_then(
    issue_after: int, desk: StandInDesk, retry_after_s: float
) -> Callable[[Request, str], EnrollReply]:
    def decide(request: Request, device_id: str) -> EnrollReply:
        if len(desk.requests()) <= issue_after:
            return EnrollReply(
                request_id=request.request_id,
                outcome="pending",
                code="pending_approval",
                message="waiting for an operator: edge-agent fleet devices accept " + device_id,
                retry_after_s=retry_after_s,
            )
        return desk.issue(request, device_id)

    return decide


def test_pending_waits_at_least_retry_after_between_requests_until_issued(
    fleet_pki: FleetPki, desk: StandInDesk, tmp_path: Path
) -> None:
    desk.decide = _pending_then(3, desk, retry_after_s=1.0)
    enrollment, thread, result = _enroll(fleet_pki, tmp_path / "dev", "jet-2")
    _finished(thread, result)

    assert len(desk.requests()) == 4
    assert enrollment.counts.outcomes == {"pending": 3, "issued": 1}
    # Each request came after the previous answer's retry_after_s (a wait, not a tight loop).
    assert all(gap >= 1.0 for gap in _gaps(desk)), _gaps(desk)
    # The same key throughout: a device that waits keeps the key its pending request named.
    csrs = {asked.request.csr_pem for asked in desk.requests()}
    assert len(csrs) == 1


def test_no_answer_is_asked_again_after_the_reply_timeout_with_backoff(
    fleet_pki: FleetPki, desk: StandInDesk, tmp_path: Path
) -> None:
    def silent_twice(request: Request, device_id: str) -> EnrollReply | None:
        return None if len(desk.requests()) <= 2 else desk.issue(request, device_id)

    desk.decide = silent_twice
    enrollment, thread, result = _enroll(
        fleet_pki, tmp_path / "dev", "jet-3", reply_timeout_s=1.0, retry_min_s=0.5
    )
    _finished(thread, result)
    assert enrollment.counts.attempts == 3
    assert all(gap >= 1.5 for gap in _gaps(desk)), _gaps(desk)


def test_refused_requests_back_off_growing_never_in_a_tight_loop(
    fleet_pki: FleetPki, desk: StandInDesk, tmp_path: Path
) -> None:
    stop = threading.Event()

    def refuse(request: Request, _device_id: str) -> EnrollReply:
        if len(desk.requests()) >= 5:
            stop.set()
        return EnrollReply(
            request_id=request.request_id, outcome="refused", code="wrong_subject", message="no"
        )

    desk.decide = refuse
    enrollment, thread, result = _enroll(
        fleet_pki, tmp_path / "dev", "jet-4", stop=stop, retry_min_s=0.4, retry_max_s=3.0
    )
    thread.join(patient(60))
    assert result == [None]  # stopped, never issued
    assert enrollment.counts.outcomes == {"refused": 5}
    assert not (tmp_path / "dev" / "device.crt").exists()
    assert all(gap >= 0.4 for gap in _gaps(desk)), _gaps(desk)


def test_a_replayed_reply_and_a_certificate_for_another_key_are_ignored_and_counted(
    fleet_pki: FleetPki, desk: StandInDesk, tmp_path: Path
) -> None:
    """A reply to an older request (a replayed acceptance) and an issued reply whose certificate is
    for another key come first on the device's reply topic; only the real answer is taken."""
    stranger = tmp_path / "stranger"
    _, thread, result = _enroll(fleet_pki, stranger, "jet-5")  # a certificate for the same id, another key
    foreign_cert = _finished(thread, result)
    assert foreign_cert.subject == "jet-5"
    stranger_reply = desk.sent[-1]
    desk.asked.clear()

    def replay_first(request: Request, device_id: str) -> EnrollReply:
        topic = enroll_reply(PREFIX, "enroll:" + device_id)
        desk.send(topic, stranger_reply)  # an old request id: a replay
        desk.send(topic, stranger_reply.model_copy(update={"request_id": request.request_id}))
        return desk.issue(request, device_id)

    desk.decide = replay_first
    device_dir = tmp_path / "dev"
    enrollment, thread, result = _enroll(fleet_pki, device_dir, "jet-5")
    facts = _finished(thread, result)
    assert enrollment.counts.foreign_replies == 2
    assert facts.serial != foreign_cert.serial
    cert = x509.load_pem_x509_certificates((device_dir / "device.crt").read_bytes())[0]
    assert is_for_key(cert, load_key(device_dir / "device.key"))


def test_the_key_is_made_once_and_kept_across_attempts_and_restarts(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "device.key"
    first = load_or_make_key(path)
    again = load_or_make_key(path)
    assert isinstance(first, ec.EllipticCurvePrivateKey)
    assert first.curve.name == "secp256r1"
    assert first.private_numbers() == again.private_numbers()
    assert path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["device.key"]  # no temporary file left
