"""Enrollment by claim: ask the enrollment listener for this device's certificate until it is issued.

Each attempt is one connection with the claim (client id ``enroll:{device_id}`` after
``mqtt.client_id_prefix``: its ACL serves only that id's topics): subscribe to the reply topic,
publish a request signed by the claim key, wait for the answer. Anything but ``issued``
(``pending``, ``rejected``, ``refused``, no answer, no broker) waits before the next attempt: at
least the reply's ``retry_after_s``, growing with every failed attempt, jittered so a batch of
devices does not ask in lockstep (:func:`agent.backoff.reconnect_delay`).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from agent.enrollment.certificate import ForeignReplyError, issued_certificate, write_certificate
from agent.enrollment.claim import Claim
from agent.enrollment.keys import (
    CertificateFacts,
    DevicePrivateKey,
    certificate_request,
    load_or_make_key,
)
from agent.enrollment.replies import ReplyInbox, log_answer, retry_delay
from agent.enrollment.settings import EnrollmentSettings
from agent.errors import ConfigError, TransportError
from agent.mqtt.service_client import ServiceClient
from agent.mqtt.settings import MqttSettings, TlsSettings
from agent.protocol.enrollment import EnrollReply, enroll_client_id
from agent.protocol.messages import encode
from agent.protocol.topics import enroll_reply, enroll_request

log = structlog.get_logger(__name__)

#: A reply to this device's request, and for ``issued`` the certificate file's bytes and facts.
Answer = tuple[EnrollReply, tuple[bytes, CertificateFacts] | None]

#: Longest wait for the enrollment listener to accept a connection.
_CONNECT_TIMEOUT_S = 15.0


@dataclass
class EnrollmentCounts:
    """What enrollment did: attempts (requests sent or tried) and replies it ignored as foreign."""

    attempts: int = 0
    foreign_replies: int = 0  # replies this device did not ask for (see certificate.ForeignReplyError)
    outcomes: dict[str, int] = field(default_factory=dict)


def identity_files(mqtt: MqttSettings) -> tuple[Path, Path, Path]:
    """``mqtt.tls``'s trust anchors, certificate and key files; ConfigError when one is not set."""
    tls = mqtt.tls
    if tls is None or tls.ca_file is None or tls.cert_file is None or tls.key_file is None:
        raise ConfigError(
            "enrollment needs mqtt.tls.ca_file, mqtt.tls.cert_file and mqtt.tls.key_file: where the "
            "fleet's trust anchors are and where the device's own certificate and key are written"
        )
    return tls.ca_file, tls.cert_file, tls.key_file


def enrollment_listener(mqtt: MqttSettings, settings: EnrollmentSettings) -> MqttSettings:
    """The connection settings of the enrollment listener: the claim as client certificate."""
    ca_file, _, _ = identity_files(mqtt)
    claim_tls = TlsSettings(
        ca_file=ca_file,
        cert_file=settings.claim_cert_file,
        key_file=settings.claim_key_file,
        insecure=mqtt.tls.insecure if mqtt.tls else False,
    )
    return mqtt.model_copy(
        update={
            "host": settings.host or mqtt.host,
            "port": settings.port,
            "tls": claim_tls,
            "username": None,
            "password_file": None,
        }
    ).with_address_from("enrollment.host/port")


class ClaimEnrollment:
    """Ask for this device's certificate with the claim until it is issued (or ``stop`` is set)."""

    def __init__(
        self,
        device_id: str,
        mqtt: MqttSettings,
        settings: EnrollmentSettings,
        *,
        stop: threading.Event,
        on_wait: Callable[[str, float], None] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        """``on_wait(why, seconds)``: told before each wait (systemd's status and start timeout)."""
        self.device_id = device_id
        self.settings = settings
        self.listener = enrollment_listener(mqtt, settings)
        _, self.cert_file, self.key_file = identity_files(mqtt)
        self.prefix = mqtt.prefix
        self.client_id = enroll_client_id(device_id)
        #: The topics' client id level: the whole client id the broker sees (its ACL's ``%c``).
        self.topic_client = enroll_client_id(device_id, mqtt.client_id_prefix)
        self._stop = stop
        self._on_wait = on_wait
        self._rng = rng or random.Random()
        self.counts = EnrollmentCounts()
        self._inbox = ReplyInbox()

    def run(self) -> CertificateFacts | None:
        """Enroll: the certificate's facts once written, or None when stopped before that."""
        claim = Claim.load(self.settings.claim_cert_file, self.settings.claim_key_file)
        key = load_or_make_key(self.key_file)
        csr_pem = certificate_request(key, self.device_id)
        failures = 0
        while not self._stop.is_set():
            request = claim.request(self.device_id, csr_pem, self.settings.serial)
            self.counts.attempts += 1
            try:
                answer = self._ask(encode(request), request.request_id, key)
            except TransportError as exc:
                log.warning("enrollment.connect.failed", error=str(exc), attempt=self.counts.attempts)
                answer = None
            if answer is None:
                self._wait("no answer", failures, 0.0)
            else:
                reply, certificate = answer
                self.counts.outcomes[reply.outcome] = self.counts.outcomes.get(reply.outcome, 0) + 1
                if certificate is not None:
                    return self._written(*certificate)
                log_answer("enrollment.answered", reply)
                self._wait(
                    f"{reply.outcome}: {reply.message or reply.code}", failures, reply.retry_after_s or 0.0
                )
            failures += 1
        return None

    def _written(self, pem: bytes, facts: CertificateFacts) -> CertificateFacts:
        write_certificate(self.cert_file, pem)
        log.info(
            "enrollment.issued",
            device=self.device_id,
            serial=facts.serial,
            not_after=facts.not_after,
            attempts=self.counts.attempts,
        )
        return facts

    def _ask(self, payload: bytes, request_id: str, key: DevicePrivateKey) -> Answer | None:
        """One attempt: connect, subscribe, publish, wait for this request's answer (None: none came)."""
        client = ServiceClient(
            self.listener, client_id=self.client_id, handler=self._inbox.on_message, reconnect=False
        )
        client.start(timeout=_CONNECT_TIMEOUT_S)
        try:
            client.subscribe(enroll_reply(self.prefix, self.topic_client), qos=1)
            client.publish(enroll_request(self.prefix, self.topic_client), payload, qos=1)
            log.info("enrollment.request.sent", device=self.device_id, request_id=request_id)
            deadline = time.monotonic() + self.settings.reply_timeout_s
            while not self._stop.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                reply = self._inbox.take(min(remaining, 0.5))
                if reply is None:
                    continue
                answer = self._answer(reply, request_id, key)
                if answer is not None:
                    return answer
            return None
        finally:
            client.stop()

    def _answer(self, reply: EnrollReply, request_id: str, key: DevicePrivateKey) -> Answer | None:
        """The answer to ``request_id`` in ``reply``; None (counted) for a reply that is not one."""
        if reply.outcome != "issued" and reply.request_id == request_id:
            return reply, None
        try:
            return reply, issued_certificate(reply, request_id=request_id, key=key, device_id=self.device_id)
        except ForeignReplyError as exc:
            self.counts.foreign_replies += 1
            log.warning("enrollment.reply.ignored", reason=str(exc), device=self.device_id)
            return None

    def _wait(self, why: str, failures: int, floor: float) -> None:
        s = self.settings
        delay = retry_delay(failures, floor, s.retry_min_s, s.retry_max_s, self._rng)
        log.info("enrollment.wait", why=why, delay_s=round(delay, 1), attempt=self.counts.attempts)
        if self._on_wait is not None:
            self._on_wait(why, delay)
        self._stop.wait(delay)
