"""Renewal: the device asks for a new certificate over its own connection before the current one expires.

Once ``renewal.at_fraction`` of the certificate's life has passed, a :class:`CertRenewal` (a request
for the same key: the controller knows it from enrollment) goes up on ``up/cert``; the answer comes on
``down/cert``. An issued certificate is checked as at enrollment, written atomically over
``mqtt.tls.cert_file``, and the link connects again with it (:meth:`MqttLink.move_to_new_certificate`)
while the frame path keeps running. A refused or unanswered request is asked again with backoff; the
old certificate keeps working until it expires.
"""

from __future__ import annotations

import random
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from agent.enrollment.certificate import (
    ForeignReplyError,
    held_certificate,
    issued_certificate,
    write_certificate,
)
from agent.enrollment.keys import CertificateFacts, certificate_request, load_key
from agent.enrollment.replies import ReplyInbox, log_answer, retry_delay
from agent.enrollment.settings import RenewalSettings
from agent.mqtt.link import MqttLink
from agent.protocol.enrollment import CertRenewal
from agent.protocol.topics import Topics

log = structlog.get_logger(__name__)

#: The renewal thread looks at the clock at least this often while it waits for the due time.
_CHECK_EVERY_S = 60.0


class CertificateRenewal:
    """Keeps the device's certificate valid: one thread, asleep until renewal is due."""

    def __init__(
        self,
        device_id: str,
        settings: RenewalSettings,
        *,
        cert_file: Path,
        key_file: Path,
        link: MqttLink,
        topics: Topics,
        stop: threading.Event,
        on_renewed: Callable[[CertificateFacts], None] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.device_id = device_id
        self.settings = settings
        self.cert_file = cert_file
        self.key_file = key_file
        self._link = link
        self._topics = topics
        self._stop = stop
        self._on_renewed = on_renewed
        self._rng = rng or random.Random()
        self._inbox = ReplyInbox()
        self._facts = held_certificate(cert_file)
        self._counts = dict.fromkeys(
            ("requests", "renewed", "refused", "unanswered", "failed", "foreign_replies"), 0
        )
        self._thread: threading.Thread | None = None

    @property
    def certificate(self) -> CertificateFacts | None:
        """The certificate the device connects with (its latest, once renewed)."""
        return self._facts

    def start(self) -> None:
        """Subscribe to ``down/cert`` (before the link connects) and start the renewal thread."""
        self._link.subscribe(self._topics.cert_reply, self._inbox.on_message, qos=1)
        self._thread = threading.Thread(target=self._run, name="cert-renewal", daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def stats(self) -> dict[str, float]:
        """For telemetry (``cert.*``): requests, renewals, refusals, unanswered, ignored replies."""
        counts = self._counts | {"foreign_replies": self._counts["foreign_replies"] + self._inbox.dropped}
        return {name: float(n) for name, n in counts.items()}

    # -- the renewal thread ----------------------------------------------------------------------

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            facts = self._facts
            if facts is None:
                log.warning("cert.renewal.no_certificate", cert_file=str(self.cert_file))
                return
            due = facts.renew_at(self.settings.at_fraction)
            if time.time() < due:
                self._stop.wait(min(due - time.time(), _CHECK_EVERY_S))
                continue
            try:
                floor = self._renew_once()
            except Exception as exc:  # a full disk or a bad key file: log, keep trying
                self._counts["failed"] += 1
                log.exception("cert.renewal.failed", error=repr(exc))
                floor = 0.0
            if floor is None:
                failures = 0
                continue
            s = self.settings
            delay = retry_delay(failures, floor, s.retry_min_s, s.retry_max_s, self._rng)
            failures += 1
            log.info("cert.renewal.wait", delay_s=round(delay, 1), failures=failures)
            self._stop.wait(delay)

    def _renew_once(self) -> float | None:
        """Ask once; None when renewed, else the least wait the controller asked for (0 if none)."""
        key = load_key(self.key_file)
        request = CertRenewal(
            request_id=secrets.token_hex(8), csr_pem=certificate_request(key, self.device_id)
        )
        self._inbox.drain()
        self._counts["requests"] += 1
        self._link.publish(self._topics.cert_renewal, request, qos=1)
        log.info("cert.renewal.requested", request_id=request.request_id)
        deadline = time.monotonic() + self.settings.reply_timeout_s
        while not self._stop.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._counts["unanswered"] += 1
                log.warning("cert.renewal.unanswered", request_id=request.request_id)
                return 0.0
            reply = self._inbox.take(min(remaining, 0.5))
            if reply is None:
                continue
            if reply.outcome != "issued" and reply.request_id == request.request_id:
                self._counts["refused"] += 1
                log_answer("cert.renewal.refused", reply)
                return reply.retry_after_s or 0.0
            try:
                pem, facts = issued_certificate(
                    reply, request_id=request.request_id, key=key, device_id=self.device_id
                )
            except ForeignReplyError as exc:
                self._counts["foreign_replies"] += 1
                log.warning("cert.renewal.reply_ignored", reason=str(exc))
                continue
            write_certificate(self.cert_file, pem)
            self._facts = facts
            self._counts["renewed"] += 1
            log.info("cert.renewal.renewed", serial=facts.serial, not_after=facts.not_after)
            self._link.move_to_new_certificate()
            if self._on_renewed is not None:
                self._on_renewed(facts)
            return None
        return 0.0
