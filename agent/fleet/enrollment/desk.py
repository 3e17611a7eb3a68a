"""The controller's enrollment desk: it answers ``{prefix}/enroll/enroll:{device}/request`` (a device
holding a claim asks for its certificate) and ``{prefix}/{device}/up/cert`` (an enrolled device
renews), and carries out the operator's ``fleet devices register|pending|accept|reject``.

A request is checked in this order, each failure a ``refused`` reply naming its code
(docs/enrollment.md): the client id names a device id; the payload is an :class:`EnrollRequest` of
at most :data:`MAX_REQUEST_BYTES`; its device id is the client id's; the claim is a current
certificate of the claims CA that signed the request; the claims ledger knows it and it has uses
left; the CSR is for that id with an accepted key. Then :func:`.admission.admit` decides.

Requests are queued by the MQTT dispatcher (bounded: a full queue drops and counts, the device asks
again after its backoff) and answered on the desk's own thread. Every reply says how long to wait
before asking again, so a pending, rejected or refused device never asks in a tight loop.
"""

from __future__ import annotations

import contextlib
import json
import queue
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import structlog

from agent.errors import AgentError
from agent.fleet.base.untrusted import shown
from agent.fleet.ca.authority import DeviceAuthority, Issued
from agent.fleet.ca.claims import ClaimRefused, read_claims, verify_claim
from agent.fleet.ca.csr import CheckedCsr, CsrRefused, check_csr
from agent.fleet.enrollment.admission import Known, admit
from agent.fleet.enrollment.book import ClaimUsedUpError, Enrolled, EnrollmentBook, Pending
from agent.fleet.enrollment.registered_file import read_registered_file
from agent.fleet.enrollment.settings import EnrollmentSettings
from agent.mqtt.inbound import InboundMessage
from agent.protocol.enrollment import (
    MAX_MESSAGE_CHARS,
    CertRenewal,
    EnrollOutcome,
    EnrollReply,
    EnrollRequest,
    device_of_enroll_client,
)
from agent.protocol.messages import ProtocolError, decode, encode
from agent.protocol.topics import Topics, enroll_client_of, enroll_reply, parse

log = structlog.get_logger(__name__)

#: Largest request payload read (a request's PEM fields are at most 16 KiB each).
MAX_REQUEST_BYTES = 64 * 1024
#: The request id of a reply to a request too broken to name its own.
UNKNOWN_REQUEST = "unknown"
#: A pending request asked again sooner than this after the last is not written down again.
TOUCH_EVERY_S = 10.0
#: Why a device waits when it holds a certificate already: accepting it needs ``--reenroll``.
REENROLLING = frozenset({"already_enrolled", "revoked"})
_REQUEST_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

M = TypeVar("M", EnrollRequest, CertRenewal)

#: ``publish(topic, payload)``: a QoS 1 publish on the controller's connection.
Publish = Callable[[str, bytes], None]


class AdmissionError(AgentError):
    """An operator's ``fleet devices`` action the desk refuses; ``code`` says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Refusal(Exception):  # noqa: N818 - control flow inside the desk: a reply, not a crash
    def __init__(self, code: str, message: str, outcome: EnrollOutcome = "refused") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.outcome: EnrollOutcome = outcome


class EnrollmentDesk:
    """Answers enrollment and renewal requests (see the module docstring): ``take`` on the MQTT
    dispatcher, ``start``/``stop``; the operator's actions from any thread."""

    def __init__(
        self,
        settings: EnrollmentSettings,
        ca_dir: Path,
        book_path: Path,
        *,
        prefix: str,
        publish: Publish,
    ) -> None:
        self.settings = settings
        self.prefix = prefix
        self._ca_dir = ca_dir
        self._book_path = book_path
        self._publish = publish
        self.authority: DeviceAuthority | None = None
        self.book: EnrollmentBook | None = None
        self._queue: queue.Queue[InboundMessage | None] = queue.Queue(maxsize=settings.queue)
        self._thread: threading.Thread | None = None
        #: One decision at a time: the desk's thread and an operator's accept never issue twice.
        self._lock = threading.Lock()
        #: Replies since start by outcome, refusals by code, requests dropped (a full queue).
        self.outcomes: Counter[str] = Counter()
        self.refusals: Counter[str] = Counter()
        self.dropped = 0

    # -- lifecycle ----------------------------------------------------------------------------------

    def start(self, book: EnrollmentBook | None = None) -> None:
        """Load the CA, open the records (``book``: the controller's, in its database; none: the
        SQLite file), read the registered file, start answering."""
        self.authority = DeviceAuthority.load(self._ca_dir)
        self.book = EnrollmentBook(self._book_path) if book is None else book
        self.book.forget_registrations("file")
        if self.settings.registered_file is not None:
            for device_id, serial in read_registered_file(self.settings.registered_file):
                self.book.register(device_id, serial, source="file")
        self._thread = threading.Thread(target=self._run, name="enrollment-desk", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        if self._thread is not None:
            with contextlib.suppress(queue.Full):
                self._queue.put(None, timeout=timeout)
            self._thread.join(timeout)
            self._thread = None
        if self.book is not None:
            self.book.close()

    def take(self, message: InboundMessage) -> bool:
        """Dispatcher thread: queue ``message`` when it is an enrollment or renewal request (True)."""
        topic = message.topic
        if not (
            topic.endswith("/up/cert")
            or (topic.startswith(f"{self.prefix}/enroll/") and topic.endswith("/request"))
        ):
            return False
        try:
            self._queue.put_nowait(message)
        except queue.Full:
            self.dropped += 1
        return True

    def _run(self) -> None:
        crl_due_at = time.monotonic() + self.settings.crl_check_s
        while True:
            idle = False
            try:
                message = self._queue.get(timeout=max(0.0, crl_due_at - time.monotonic()))
            except queue.Empty:
                message, idle = None, True
            if time.monotonic() >= crl_due_at:
                # A controller that runs for months must keep the CRL current on its own.
                self._renew_crl()
                crl_due_at = time.monotonic() + self.settings.crl_check_s
            if idle:
                continue
            if message is None:
                return
            try:
                if message.topic.endswith("/up/cert"):
                    self._renewal(message)
                else:
                    self._enrollment(message)
            except Exception:  # the desk outlives any one request
                log.exception("fleet.enroll.request_failed", topic=shown(message.topic, 200))

    def _renew_crl(self) -> None:
        assert self.authority is not None
        try:
            self.authority.renew_crl_if_due()
        except Exception:  # the desk outlives a failed write; the next check tries again
            log.exception("fleet.enroll.crl_renewal_failed")

    # -- enrollment ---------------------------------------------------------------------------------

    def _enrollment(self, message: InboundMessage) -> None:
        try:
            client = enroll_client_of(message.topic, self.prefix)
        except ValueError:
            self.dropped += 1
            return
        if len(client) > 100:  # no device id is that long: nobody to answer
            self.dropped += 1
            return
        reply_to = enroll_reply(self.prefix, client)
        request_id = _request_id_of(message.payload)
        try:
            request = self._enroll_request(client, message.payload)
            request_id = request.request_id
            with self._lock:
                reply = self._admit(request, client)
        except _Refusal as refusal:
            reply = self._refusal(request_id, refusal)
        self._send(reply_to, reply)

    def _enroll_request(self, client: str, payload: bytes) -> EnrollRequest:
        device_id = device_of_enroll_client(client)
        if device_id is None:
            raise _Refusal(
                "bad_device_id",
                f"client id {shown(client, 80)} is not [prefix]enroll:DEVICE_ID with a device id of 1-64 "
                "letters, digits, '_', '.' or '-'",
            )
        request = _decoded(EnrollRequest, payload)
        if request.device_id != device_id:
            raise _Refusal(
                "id_mismatch",
                f"the request is for {shown(request.device_id, 64)}, sent as client {shown(client, 100)}",
            )
        return request

    def _admit(self, request: EnrollRequest, client: str) -> EnrollReply:
        assert self.book is not None
        device_id = request.device_id
        claim = self._claim(request)
        checked = _checked(request.csr_pem, device_id)
        enrolled = self.book.enrolled(device_id)
        known = Known(
            enrolled,
            self.book.pending(device_id),
            self.book.rejected(device_id),
            self.book.registration_of_id(device_id),
            None if request.serial is None else self.book.registration_of_serial(request.serial),
            revoked=enrolled is not None and self._revoked(device_id, enrolled.serial),
        )
        verdict = admit(device_id, request.serial, checked.fingerprint, known)
        if verdict.action == "resend":
            assert known.enrolled is not None
            return _issued_reply(request.request_id, known.enrolled.cert_pem, known.enrolled.chain_pem)
        if verdict.action == "refuse":
            raise _Refusal(verdict.code, verdict.message)
        if verdict.action == "rejected":
            raise _Refusal(verdict.code, verdict.message, "rejected")
        now = time.time()
        if verdict.action == "touch":
            assert known.pending is not None
            if now - known.pending.last_at >= TOUCH_EVERY_S:
                self.book.touch_pending(device_id, contested=False, at=now)
            return self._pending_reply(request.request_id, verdict.code, verdict.message)
        limit = self._check_uses_left(claim)
        if verdict.action == "issue":
            issued = self._issue(
                checked,
                claim=claim,
                hw_serial=request.serial,
                request_id=request.request_id,
                spends=limit,
            )
            return _issued_reply(request.request_id, issued.cert_pem.decode(), issued.chain_pem.decode())
        self.book.forget_pending_before(now - self.settings.pending_forget_s)
        total, of_claim = self.book.pending_counts(claim)
        if total >= self.settings.max_pending or of_claim >= self.settings.max_pending_per_claim:
            raise _Refusal(
                "pending_full",
                f"{total} devices wait for an operator ({of_claim} with claim {claim}); ask again later",
            )
        self.book.add_pending(
            Pending(
                device_id, claim, request.serial, checked.fingerprint, request.csr_pem, request.request_id,
                verdict.code, now, now, 1, 0, client,
            )
        )  # fmt: skip
        log.info("fleet.enroll.pending", device=device_id, claim=claim, code=verdict.code)
        return self._pending_reply(request.request_id, verdict.code, verdict.message)

    def _revoked(self, device_id: str, serial: str) -> bool:
        """Whether the CA revoked ``device_id``'s certificate ``serial`` (``fleet devices revoke``)."""
        assert self.authority is not None
        return any(
            r.serial == serial and r.revoked_at is not None for r in self.authority.certificates_of(device_id)
        )

    def _claim(self, request: EnrollRequest) -> str:
        """The name of the claim that signed ``request`` (a refusal when it is not a good one)."""
        assert self.authority is not None
        try:
            proof = verify_claim(
                request.claim_cert_pem.encode(),
                bytes.fromhex(request.claim_signature),
                request.signed_bytes(),
                self.authority.claims_ca,
            )
        except ClaimRefused as exc:
            raise _Refusal(exc.code, exc.message) from exc
        except ValueError as exc:  # an odd number of hex digits
            raise _Refusal("bad_claim_signature", f"the signature is not hex of DER: {exc}") from exc
        record = read_claims(self._ca_dir).get(proof.name)
        if record is None or record.serial != proof.serial:
            raise _Refusal("bad_claim", f"claim {proof.name} is not in this controller's claims ledger")
        return proof.name

    def _check_uses_left(self, claim: str) -> int:
        """How many devices ``claim`` may enroll (a refusal when it has enrolled them all)."""
        assert self.book is not None
        record = read_claims(self._ca_dir).get(claim)
        used = self.book.claim_uses(claim)
        if record is None or used >= record.uses:
            limit = 0 if record is None else record.uses
            raise _Refusal("claim_used_up", f"claim {claim} has enrolled {used} of its {limit} devices")
        return record.uses

    def _issue(
        self,
        checked: CheckedCsr,
        *,
        claim: str | None,
        hw_serial: str | None,
        request_id: str,
        spends: int | None,
    ) -> Issued:
        """Sign ``checked`` and record the device as enrolled with it (``spends``: one use of ``claim``,
        which may enroll that many devices; None: a renewal, which spends nothing)."""
        assert self.authority is not None
        assert self.book is not None
        issued = self.authority.issue(checked, self.settings.certificate_days)
        device_id = checked.device_id
        try:
            self.book.enroll(
                Enrolled(
                    device_id, checked.fingerprint, issued.serial, issued.not_after.timestamp(), time.time(),
                    claim, hw_serial, request_id, issued.cert_pem.decode(), issued.chain_pem.decode(),
                ),
                spends_claim=spends is not None,
                claim_limit=spends,
            )  # fmt: skip
        except ClaimUsedUpError as exc:
            # Only another controller on the same database spending the last use meanwhile gets
            # here: the certificate signed above is in the CA's ledger, never sent.
            raise _Refusal("claim_used_up", str(exc)) from exc
        log.info("fleet.enroll.issued", device=device_id, serial=issued.serial, claim=claim)
        return issued

    # -- renewal ------------------------------------------------------------------------------------

    def _renewal(self, message: InboundMessage) -> None:
        try:
            device_id = parse(message.topic, self.prefix).device
        except ValueError:
            self.dropped += 1
            return
        request_id = _request_id_of(message.payload)
        try:
            renewal = _decoded(CertRenewal, message.payload)
            request_id = renewal.request_id
            with self._lock:
                reply = self._renew(device_id, renewal)
        except _Refusal as refusal:
            reply = self._refusal(request_id, refusal)
        self._send(Topics(self.prefix, device_id).cert_reply, reply)

    def _renew(self, device_id: str, renewal: CertRenewal) -> EnrollReply:
        assert self.book is not None
        enrolled = self.book.enrolled(device_id)
        if enrolled is None:
            raise _Refusal("not_enrolled", f"{device_id} holds no certificate of this desk; enroll it first")
        if self._revoked(device_id, enrolled.serial):
            # Only a broker without the CRL and the devices ACL lets a revoked certificate publish
            # here; a renewal would lift its revocation, so it goes through the operator instead.
            raise _Refusal("revoked", f"{device_id}'s certificate is revoked; an operator re-enrolls it")
        if renewal.request_id == enrolled.request_id:
            return _issued_reply(renewal.request_id, enrolled.cert_pem, enrolled.chain_pem)
        wait = enrolled.issued_at + self.settings.min_renew_interval_s - time.time()
        if wait > 0:
            raise _Refusal(
                "too_soon",
                f"{device_id}'s certificate is newer than {self.settings.min_renew_interval_s:.0f}s; "
                f"renew in {wait:.0f}s",
            )
        checked = _checked(renewal.csr_pem, device_id)
        issued = self._issue(
            checked,
            claim=enrolled.claim,
            hw_serial=enrolled.hw_serial,
            request_id=renewal.request_id,
            spends=None,
        )
        self.outcomes["renewed"] += 1
        return _issued_reply(renewal.request_id, issued.cert_pem.decode(), issued.chain_pem.decode())

    # -- the operator's actions ---------------------------------------------------------------------

    def register(self, device_id: str | None, serial: str | None) -> dict[str, Any]:
        """``fleet devices register [ID] [--serial S]``: admitted at once from now on."""
        assert self.book is not None
        if device_id is None and serial is None:
            raise AdmissionError("bad_request", "register needs a device id, a --serial, or both")
        if device_id is not None:
            _check_id(device_id)
        if serial is not None and not 0 < len(serial) <= 128:
            raise AdmissionError("bad_request", "a serial is 1-128 characters")
        self.book.register(device_id, serial)
        return {"device_id": device_id, "serial": serial, "registered": True}

    def pending_list(self) -> dict[str, Any]:
        """``fleet devices pending``: who waits, oldest first."""
        assert self.book is not None
        waiting = self.book.pending_list()
        return {"pending": [p.as_dict() for p in waiting], "max_pending": self.settings.max_pending}

    def enrolled_list(self) -> dict[str, Any]:
        """The enrolled devices, their certificates' serials and expiries."""
        assert self.book is not None
        return {"enrolled": [e.as_dict() for e in self.book.enrolled_list()]}

    def accept(self, device_id: str, *, reenroll: bool = False) -> dict[str, Any]:
        """``fleet devices accept ID [--reenroll]``: issue the waiting request's certificate and send
        it to the device. Accepting again what was accepted answers the same, with no second certificate."""
        assert self.book is not None
        _check_id(device_id)
        with self._lock:
            waiting = self.book.pending(device_id)
            if waiting is None:
                enrolled = self.book.enrolled(device_id)
                if enrolled is None:
                    raise AdmissionError(
                        "not_pending", f"{device_id} is not waiting: see `fleet devices pending`"
                    )
                return {"device_id": device_id, "accepted": True, "already": True, **enrolled.as_dict()}
            if waiting.code in REENROLLING and not reenroll:
                raise AdmissionError(
                    "reenroll_needed",
                    f"{device_id} is enrolled already ({waiting.code}); accept it with --reenroll to revoke "
                    "the old certificate and issue one for the new key",
                )
            try:
                limit = self._check_uses_left(waiting.claim)
                checked = _checked(waiting.csr_pem, device_id)
                revoked: list[str] = []
                if waiting.code in REENROLLING:
                    assert self.authority is not None
                    revoked = self.authority.revoke_device(device_id, "re-enrolled by an operator")
                issued = self._issue(
                    checked,
                    claim=waiting.claim,
                    hw_serial=waiting.serial,
                    request_id=waiting.request_id,
                    spends=limit,
                )
            except _Refusal as refusal:
                raise AdmissionError(refusal.code, refusal.message) from refusal
        reply = _issued_reply(waiting.request_id, issued.cert_pem.decode(), issued.chain_pem.decode())
        self._send(enroll_reply(self.prefix, waiting.client), reply)
        return {
            "device_id": device_id,
            "accepted": True,
            "already": False,
            "serial": issued.serial,
            "not_after": issued.not_after.timestamp(),
            "revoked": revoked,
        }

    def reject(self, device_id: str, reason: str) -> dict[str, Any]:
        """``fleet devices reject ID``: it leaves the pending list, and its requests are answered
        ``rejected`` until it is registered."""
        assert self.book is not None
        _check_id(device_id)
        with self._lock:
            was_pending = self.book.reject(device_id, reason[:200] or "rejected by an operator")
        return {"device_id": device_id, "rejected": True, "was_pending": was_pending}

    # -- replies ------------------------------------------------------------------------------------

    def _refusal(self, request_id: str, refusal: _Refusal) -> EnrollReply:
        retry = (
            self.settings.rejected_retry_s if refusal.outcome == "rejected" else self.settings.refused_retry_s
        )
        if refusal.outcome == "refused":
            self.refusals[refusal.code] += 1
        return EnrollReply(
            request_id=request_id,
            outcome=refusal.outcome,
            code=refusal.code,
            message=_one_line(refusal.message),
            retry_after_s=retry,
        )

    def _pending_reply(self, request_id: str, code: str, message: str) -> EnrollReply:
        return EnrollReply(
            request_id=request_id,
            outcome="pending",
            code=code,
            message=_one_line(message),
            retry_after_s=self.settings.pending_retry_s,
        )

    def _send(self, topic: str, reply: EnrollReply) -> None:
        self.outcomes[reply.outcome] += 1
        self._publish(topic, encode(reply))


def _decoded(model: type[M], payload: bytes) -> M:
    if len(payload) > MAX_REQUEST_BYTES:
        raise _Refusal("bad_request", f"request of {len(payload)} bytes; at most {MAX_REQUEST_BYTES}")
    try:
        return decode(model, payload)
    except ProtocolError as exc:
        raise _Refusal("bad_request", str(exc)) from exc


def _checked(csr_pem: str, device_id: str) -> CheckedCsr:
    try:
        return check_csr(csr_pem.encode(), device_id)
    except CsrRefused as exc:
        raise _Refusal(exc.code, exc.message) from exc


def _check_id(device_id: str) -> None:
    if device_of_enroll_client(f"enroll:{device_id}") is None:
        raise AdmissionError("bad_device_id", f"{shown(device_id, 80)} is not a device id")


def _issued_reply(request_id: str, cert_pem: str, chain_pem: str) -> EnrollReply:
    return EnrollReply(request_id=request_id, outcome="issued", cert_pem=cert_pem, chain_pem=chain_pem)


def _one_line(message: str) -> str:
    return shown(message, MAX_MESSAGE_CHARS)


def _request_id_of(payload: bytes) -> str:
    """The request id a broken request names, if it names a valid one (its reply echoes it)."""
    try:
        value = json.loads(payload[:MAX_REQUEST_BYTES])
    except (UnicodeDecodeError, ValueError):
        return UNKNOWN_REQUEST
    found = value.get("request_id") if isinstance(value, dict) else None
    return found if isinstance(found, str) and _REQUEST_ID.match(found) else UNKNOWN_REQUEST
