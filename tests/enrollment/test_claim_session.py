"""Enrollment by claim against the documented broker (configs/mosquitto/) and a real controller.

Each test's device enrolls as the agent does (:class:`ClaimEnrollment`); the controller's desk answers
(registered: issued at once; unknown: pending until ``fleet devices accept``; rejected), or is killed
to leave the device unanswered; the operator's client injects replayed and foreign replies.
"""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from agent.enrollment.claim_session import ClaimEnrollment
from agent.enrollment.keys import CertificateFacts, is_for_key, load_key, load_or_make_key
from agent.mqtt.service_client import ServiceClient
from agent.protocol.enrollment import EnrollReply, EnrollRequest
from agent.protocol.messages import decode, encode
from agent.protocol.topics import Topics, enroll_reply
from tests.enrollment.enrollment_fleet import CLIENT_ID_PREFIX, PREFIX, EnrollmentFleet, Seen
from tests.fleet.ca.ca_rig import device_key_and_csr
from tests.waiting import patient, wait_until


class Enrolling:
    """A device enrolling in a thread, as the agent's first start does."""

    def __init__(self, fleet: EnrollmentFleet, device_dir: Path, device_id: str, **settings: object) -> None:
        self.stop = threading.Event()
        self.enrollment = ClaimEnrollment(
            device_id, fleet.device_mqtt(device_dir), fleet.enrollment(**settings), stop=self.stop
        )
        self.result: list[CertificateFacts | None] = []
        self.thread = threading.Thread(target=lambda: self.result.append(self.enrollment.run()), daemon=True)
        self.thread.start()

    def finished(self) -> CertificateFacts | None:
        self.thread.join(patient(60))
        assert not self.thread.is_alive(), "enrollment did not finish"
        return self.result[0]

    def issued(self) -> CertificateFacts:
        facts = self.finished()
        assert facts is not None
        return facts


def _gaps(seen: list[Seen]) -> list[float]:
    return [b.at - a.at for a, b in itertools.pairwise(seen)]


def test_a_registered_device_with_only_a_claim_gets_its_own_certificate_and_connects_with_it(
    fleet: EnrollmentFleet, tmp_path: Path
) -> None:
    fleet.devices("register", {"device_id": "jet-1", "serial": None})
    device_dir = tmp_path / "dev"
    facts = Enrolling(fleet, device_dir, "jet-1").issued()

    key_file, cert_file = device_dir / "device.key", device_dir / "device.crt"
    assert key_file.stat().st_mode & 0o777 == 0o600
    cert = x509.load_pem_x509_certificates(cert_file.read_bytes())
    assert facts.subject == "jet-1"
    assert is_for_key(cert[0], load_key(key_file))
    assert len(cert) == 2  # the leaf and the devices intermediate: what TLS presents
    assert fleet.authority().certificates_of("jet-1")[0].serial == facts.serial
    (request,) = fleet.requests()
    assert request.topic == f"{PREFIX}/enroll/{CLIENT_ID_PREFIX}enroll:jet-1/request"
    assert b"PRIVATE KEY" not in request.payload  # the key never left the device

    # An ordinary device from here on: its own certificate on the devices listener, its own tree.
    assert fleet.operator is not None
    fleet.operator.subscribe(f"{PREFIX}/jet-1/up/#", qos=1)
    device = ServiceClient(fleet.device_mqtt(device_dir), client_id="jet-1").start()
    try:
        device.publish(Topics(PREFIX, "jet-1").status, b'{"state":"online"}', qos=1)
        wait_until(lambda: any(s.topic.endswith("jet-1/up/status") for s in fleet.seen), what="its status")
    finally:
        device.stop()


def test_a_pending_device_asks_at_most_as_often_as_told_until_an_operator_accepts_it(
    fleet: EnrollmentFleet, tmp_path: Path
) -> None:
    enrolling = Enrolling(fleet, tmp_path / "dev", "jet-2")
    wait_until(lambda: len(fleet.requests()) >= 3, timeout=60, what="three pending requests")
    pending = fleet.devices("pending")
    assert "jet-2" in str(pending)
    fleet.devices("accept", {"device_id": "jet-2", "reenroll": False})
    facts = enrolling.issued()

    outcomes = enrolling.enrollment.counts.outcomes
    assert outcomes["pending"] >= 3
    assert outcomes["issued"] == 1
    # Each request came at least the desk's retry_after_s (pending_retry_s: 1 s) after the last.
    assert all(gap >= 1.0 for gap in _gaps(fleet.requests())), _gaps(fleet.requests())
    # One key throughout: the certificate the operator accepted is for the key the device holds.
    csrs = {decode(EnrollRequest, s.payload).csr_pem for s in fleet.requests()}
    assert len(csrs) == 1
    assert facts.serial == fleet.authority().certificates_of("jet-2")[0].serial


def test_a_rejected_device_learns_why_and_backs_off_never_in_a_tight_loop(
    fleet: EnrollmentFleet, tmp_path: Path
) -> None:
    enrolling = Enrolling(fleet, tmp_path / "dev", "jet-4", retry_min_s=0.4, retry_max_s=3.0)
    wait_until(lambda: len(fleet.requests()) >= 1, timeout=60, what="a pending request")
    fleet.devices("reject", {"device_id": "jet-4", "reason": "not one of ours"})
    first_after = len(fleet.requests())
    wait_until(lambda: len(fleet.requests()) >= first_after + 3, timeout=60, what="three more requests")
    enrolling.stop.set()
    assert enrolling.finished() is None
    assert enrolling.enrollment.counts.outcomes.get("rejected", 0) >= 2
    assert not (tmp_path / "dev" / "device.crt").exists()
    replies = [decode(EnrollReply, s.payload) for s in fleet.seen if s.topic.endswith("/reply")]
    assert any(r.outcome == "rejected" and "not one of ours" in r.message for r in replies)
    assert all(gap >= 0.4 for gap in _gaps(fleet.requests())), _gaps(fleet.requests())


def test_no_answer_while_the_controller_is_down_is_asked_again_after_the_reply_timeout(
    fleet: EnrollmentFleet, tmp_path: Path
) -> None:
    fleet.devices("register", {"device_id": "jet-3", "serial": None})
    fleet.controller.kill()
    enrolling = Enrolling(fleet, tmp_path / "dev", "jet-3", reply_timeout_s=1.0, retry_min_s=0.5)
    wait_until(lambda: len(fleet.requests()) >= 2, timeout=60, what="two unanswered requests")
    fleet.controller.start()
    facts = enrolling.issued()
    assert facts.subject == "jet-3"
    assert enrolling.enrollment.counts.attempts >= 3
    assert all(gap >= 1.5 for gap in _gaps(fleet.requests())), _gaps(fleet.requests())


def test_a_replayed_reply_and_a_certificate_for_another_key_are_ignored_and_counted(
    fleet: EnrollmentFleet, tmp_path: Path
) -> None:
    """While the controller is down, the device's reply topic gets a replayed acceptance (another
    request id) and an answer naming its request whose certificate is for another key; it takes
    neither, and takes the controller's answer once it is back."""
    fleet.devices("register", {"device_id": "jet-5", "serial": None})
    fleet.controller.kill()
    _, checked = device_key_and_csr("jet-5")
    stranger = fleet.authority().issue(checked, 1)  # the same id, another key
    foreign = EnrollReply(
        request_id="replayed1",
        outcome="issued",
        cert_pem=stranger.cert_pem.decode(),
        chain_pem=stranger.chain_pem.decode(),
    )

    def replay(seen: Seen) -> None:
        request = decode(EnrollRequest, seen.payload)
        topic = enroll_reply(PREFIX, seen.topic.split("/")[-2])
        assert fleet.operator is not None
        fleet.operator.publish(topic, encode(foreign), qos=1)
        fleet.operator.publish(
            topic, encode(foreign.model_copy(update={"request_id": request.request_id})), qos=1
        )

    fleet.on_request = replay
    device_dir = tmp_path / "dev"
    enrolling = Enrolling(fleet, device_dir, "jet-5", reply_timeout_s=3.0)
    wait_until(
        lambda: enrolling.enrollment.counts.foreign_replies >= 2, timeout=60, what="two foreign replies"
    )
    fleet.on_request = None
    fleet.controller.start()
    facts = enrolling.issued()
    assert enrolling.enrollment.counts.foreign_replies == 2
    assert facts.serial != stranger.serial
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
