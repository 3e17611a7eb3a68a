"""Renewal over the device's own connection, against a real mosquitto and the real fleet CA.

The controller's side is :class:`~tests.enrollment.fleet_pki.StandInDesk` (the real CA API in place
of the admission desk). The renewal is made due seconds after enrollment by ``at_fraction``: the
certificate the CA issues lives a day, and the test cannot wait two thirds of one.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.enrollment.certificate import held_certificate
from agent.enrollment.claim_session import ClaimEnrollment
from agent.enrollment.keys import CertificateFacts
from agent.enrollment.renewal import CertificateRenewal
from agent.enrollment.settings import RenewalSettings
from agent.mqtt.link import MqttLink
from agent.protocol.enrollment import CertRenewal, EnrollReply, EnrollRequest
from agent.protocol.topics import Topics
from agent.spool.queue import Spool
from tests.enrollment.fleet_pki import PREFIX, FleetPki, StandInDesk
from tests.mqtt_probe import Probe
from tests.waiting import patient, wait_until

DEVICE = "jet-r"


class Enrolled:
    """A device enrolled by claim, its link on the devices listener and its renewal (not started)."""

    def __init__(self, pki: FleetPki, directory: Path, renew_in_s: float, **renewal: object) -> None:
        self.dir = directory
        self.stop = threading.Event()
        self.mqtt = pki.device_mqtt(directory)
        facts = ClaimEnrollment(DEVICE, self.mqtt, pki.enrollment(), stop=self.stop).run()
        assert facts is not None
        self.first: CertificateFacts = facts
        life = facts.not_after - facts.not_before
        at_fraction = (time.time() - facts.not_before + renew_in_s) / life
        self.topics = Topics(PREFIX, DEVICE)
        self.spool = Spool(directory / "spool.sqlite")
        self.link = MqttLink(
            self.mqtt,
            client_id=DEVICE,
            status_topic=self.topics.status,
            agent_version="0.0.test",
            spool=self.spool,
        )
        settings = {
            "at_fraction": at_fraction,
            "reply_timeout_s": 5.0,
            "retry_min_s": 0.5,
            "retry_max_s": 2.0,
        }
        self.renewal = CertificateRenewal(
            DEVICE,
            RenewalSettings.model_validate(settings | renewal),
            cert_file=directory / "device.crt",
            key_file=directory / "device.key",
            link=self.link,
            topics=self.topics,
            stop=self.stop,
        )

    def start(self) -> None:
        self.renewal.start()
        self.link.start()
        assert self.link.wait_connected(patient(10))

    def close(self) -> None:
        self.stop.set()
        self.renewal.join(2.0)
        self.link.stop(timeout=1.0)
        self.spool.close()


@pytest.fixture
def make_enrolled(
    fleet_pki: FleetPki, desk: StandInDesk, tmp_path: Path
) -> Iterator[Callable[..., Enrolled]]:
    made: list[Enrolled] = []

    def make(renew_in_s: float, **renewal: object) -> Enrolled:
        device = Enrolled(fleet_pki, tmp_path / "dev", renew_in_s, **renewal)
        made.append(device)
        return device

    yield make
    for device in made:
        device.close()


def test_a_renewed_certificate_is_written_and_the_link_moves_to_it_losing_no_durable_message(
    fleet_pki: FleetPki, desk: StandInDesk, make_enrolled: Callable[..., Enrolled]
) -> None:
    device = make_enrolled(3.0)
    probe = Probe(fleet_pki.broker.host, fleet_pki.broker.port)
    probe.subscribe(f"{PREFIX}/{DEVICE}/up/#")
    device.start()
    sent = 0
    stop_sending = threading.Event()

    def send() -> None:
        nonlocal sent
        for i in itertools.count():
            if stop_sending.is_set():
                return
            device.link.publish(device.topics.results("cam"), json.dumps({"i": i}).encode(), durable=True)
            sent = i + 1
            time.sleep(0.02)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        wait_until(lambda: device.renewal.stats()["renewed"] >= 1, timeout=30, what="a renewal")
        wait_until(lambda: device.link.counter("certificate_moves") >= 1 and device.link.connected, 30)
        first_after = sent
        wait_until(lambda: sent >= first_after + 20, timeout=30, what="messages after the move")
    finally:
        stop_sending.set()
        sender.join(5)
    results = probe.wait_for(
        lambda msgs: (
            {json.loads(m.payload)["i"] for m in msgs if "/up/results/" in m.topic} >= set(range(sent))
        ),
        timeout=30,
    )
    renewed = held_certificate(device.dir / "device.crt")
    assert renewed is not None
    assert renewed.serial != device.first.serial
    assert device.renewal.certificate is not None
    assert renewed.serial in {r.serial for r in fleet_pki.authority.certificates_of(DEVICE)}
    assert device.link.counter("reconnects") >= 1
    # A DISCONNECT, not a lost connection: the broker published no Last Will (offline) meanwhile.
    statuses = [json.loads(m.payload)["state"] for m in results if m.topic.endswith("/up/status")]
    assert "offline" not in statuses
    probe.close()


def test_a_refused_renewal_is_asked_again_with_backoff_and_the_old_certificate_keeps_working(
    fleet_pki: FleetPki, desk: StandInDesk, make_enrolled: Callable[..., Enrolled]
) -> None:
    def refuse_renewals(request: EnrollRequest | CertRenewal, device_id: str) -> EnrollReply:
        if isinstance(request, EnrollRequest):
            return desk.issue(request, device_id)
        return EnrollReply(
            request_id=request.request_id,
            outcome="refused",
            code="not_enrolled",
            message="no",
            retry_after_s=0.7,
        )

    desk.decide = refuse_renewals
    device = make_enrolled(1.0)
    device.start()
    wait_until(lambda: device.renewal.stats()["refused"] >= 3, timeout=60, what="three refused renewals")
    renewals = [asked.at for asked in desk.requests() if isinstance(asked.request, CertRenewal)]
    assert all(b - a >= 0.7 for a, b in itertools.pairwise(renewals))
    assert device.link.connected
    assert device.link.counter("reconnects") == 0
    assert device.link.counter("certificate_moves") == 0
    held = held_certificate(device.dir / "device.crt")
    assert held is not None
    assert held.serial == device.first.serial


def test_an_unanswered_renewal_is_asked_again_after_the_reply_timeout(
    fleet_pki: FleetPki, desk: StandInDesk, make_enrolled: Callable[..., Enrolled]
) -> None:
    def silent_then_issue(request: EnrollRequest | CertRenewal, device_id: str) -> EnrollReply | None:
        renewals = [a for a in desk.requests() if isinstance(a.request, CertRenewal)]
        if isinstance(request, CertRenewal) and len(renewals) <= 1:
            return None
        return desk.issue(request, device_id)

    desk.decide = silent_then_issue
    device = make_enrolled(1.0, reply_timeout_s=1.0)
    device.start()
    wait_until(lambda: device.renewal.stats()["renewed"] >= 1, timeout=60, what="a renewal")
    stats = device.renewal.stats()
    assert stats["unanswered"] == 1
    renewals = [asked.at for asked in desk.requests() if isinstance(asked.request, CertRenewal)]
    assert renewals[1] - renewals[0] >= 1.5  # the reply timeout, then at least retry_min_s
