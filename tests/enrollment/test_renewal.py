"""Renewal over the device's own connection, against the documented broker and a real controller.

The renewal is made due seconds after enrollment by ``at_fraction``: the certificate the controller
issues lives a day (its shortest), and the test cannot wait two thirds of one.
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
from agent.protocol.topics import Topics
from agent.spool.queue import Spool
from tests.enrollment.enrollment_fleet import PREFIX, EnrollmentFleet, start_fleet
from tests.waiting import patient, wait_until

DEVICE = "jet-r"


class Enrolled:
    """A device enrolled by claim, its link on the devices listener and its renewal (not started)."""

    def __init__(self, fleet: EnrollmentFleet, directory: Path, renew_in_s: float, **renewal: object) -> None:
        self.dir = directory
        self.stop = threading.Event()
        self.mqtt = fleet.device_mqtt(directory)
        fleet.devices("register", {"device_id": DEVICE, "serial": None})
        facts = ClaimEnrollment(DEVICE, self.mqtt, fleet.enrollment(), stop=self.stop).run()
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
        self.renewal.join(patient(2.0))
        self.link.stop(timeout=1.0)
        self.spool.close()


@pytest.fixture
def make_enrolled(tmp_path: Path) -> Iterator[Callable[..., Enrolled]]:
    """``make_enrolled(fleet, renew_in_s, **renewal)``: a device enrolled with ``fleet``'s controller."""
    made: list[Enrolled] = []

    def make(fleet: EnrollmentFleet, renew_in_s: float, **renewal: object) -> Enrolled:
        device = Enrolled(fleet, tmp_path / "dev", renew_in_s, **renewal)
        made.append(device)
        return device

    yield make
    for device in made:
        device.close()


def _renewals(fleet: EnrollmentFleet) -> list[float]:
    return [seen.at for seen in fleet.requests("/up/cert")]


def test_a_renewed_certificate_is_written_and_the_link_moves_to_it_losing_no_durable_message(
    fleet: EnrollmentFleet, make_enrolled: Callable[..., Enrolled]
) -> None:
    device = make_enrolled(fleet, 3.0)
    assert fleet.operator is not None
    fleet.operator.subscribe(f"{PREFIX}/{DEVICE}/up/#", qos=1)
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
        sender.join(patient(5))

    def results() -> set[int]:
        return {json.loads(s.payload)["i"] for s in list(fleet.seen) if "/up/results/" in s.topic}

    wait_until(lambda: results() >= set(range(sent)), timeout=30, what="every durable message")
    renewed = held_certificate(device.dir / "device.crt")
    assert renewed is not None
    assert renewed.serial != device.first.serial
    assert device.renewal.certificate == renewed
    assert renewed.serial in {r.serial for r in fleet.authority().certificates_of(DEVICE)}
    assert device.link.counter("reconnects") >= 1
    # A DISCONNECT, not a lost connection: the broker published no Last Will (offline) meanwhile.
    statuses = [json.loads(s.payload)["state"] for s in list(fleet.seen) if s.topic.endswith("/up/status")]
    assert "offline" not in statuses


def test_a_refused_renewal_is_asked_again_with_backoff_and_the_old_certificate_keeps_working(
    tmp_path: Path, make_enrolled: Callable[..., Enrolled]
) -> None:
    """The controller refuses a renewal sooner than min_renew_interval_s (too_soon, retry after 1 s)."""
    fleet = start_fleet(tmp_path / "fleet", min_renew_interval_s=3600)
    try:
        device = make_enrolled(fleet, 1.0)
        device.start()
        wait_until(lambda: device.renewal.stats()["refused"] >= 3, timeout=60, what="three refused renewals")
        assert all(b - a >= 1.0 for a, b in itertools.pairwise(_renewals(fleet))), _renewals(fleet)
        assert device.link.connected
        assert device.link.counter("reconnects") == 0
        assert device.link.counter("certificate_moves") == 0
        held = held_certificate(device.dir / "device.crt")
        assert held is not None
        assert held.serial == device.first.serial
    finally:
        fleet.stop()


def test_an_unanswered_renewal_is_asked_again_after_the_reply_timeout(
    fleet: EnrollmentFleet, make_enrolled: Callable[..., Enrolled]
) -> None:
    device = make_enrolled(fleet, 1.0, reply_timeout_s=1.0)
    fleet.controller.kill()
    device.start()
    wait_until(lambda: device.renewal.stats()["unanswered"] >= 1, timeout=60, what="an unanswered renewal")
    fleet.controller.start()
    wait_until(lambda: device.renewal.stats()["renewed"] >= 1, timeout=60, what="a renewal")
    renewals = _renewals(fleet)
    assert renewals[1] - renewals[0] >= 1.5  # the reply timeout, then at least retry_min_s


def test_a_certificate_that_does_not_load_leaves_the_connection_as_it_is(
    fleet: EnrollmentFleet, make_enrolled: Callable[..., Enrolled]
) -> None:
    device = make_enrolled(fleet, 3600.0)  # renewal not due during the test
    device.start()
    (device.dir / "device.crt").write_text("not a certificate\n")
    device.link.move_to_new_certificate()
    wait_until(lambda: device.link.counter("certificate_move_failures") == 1, what="the failed reload")
    assert device.link.connected
    assert device.link.counter("reconnects") == 0
    assert device.link.counter("certificate_moves") == 0


def test_a_renewal_that_fails_on_the_device_is_logged_and_tried_again_while_the_link_serves(
    fleet: EnrollmentFleet, make_enrolled: Callable[..., Enrolled]
) -> None:
    """The key file turns unreadable after the link loaded it (a damaged disk): each renewal fails
    on the device, is counted and tried again with backoff; the connection stays."""
    device = make_enrolled(fleet, 1.0, retry_min_s=0.3)
    (device.dir / "device.key").write_text("damaged\n")
    device.start()
    wait_until(lambda: device.renewal.stats()["failed"] >= 2, timeout=60, what="two failed renewals")
    assert device.link.connected
    assert device.renewal.stats()["requests"] == 0
    assert not fleet.requests("/up/cert")
