"""A fleet's CA, a claim and a mosquitto with the enrollment and devices listeners, for the device's tests.

The CA is the real one (``fleet ca init``'s steps, ``fleet ca claim``); the broker is a real
mosquitto with three listeners: plain TCP on loopback for the operator side, the enrollment listener
(claims CA, the claim's client id may publish its request and read its reply, nothing else) and the
devices listener (device CA chain, CRL, the devices ACL the CA writes).

:class:`StandInDesk` answers enrollment and renewal requests with the real CA API
(``verify_claim``, ``check_csr``, ``DeviceAuthority.issue``). It stands in for the controller's
admission desk, which another branch builds; once that is merged, the end-to-end test runs the real
controller instead (tests/e2e/test_enrollment.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agent.demo.broker import Broker, free_port
from agent.enrollment.settings import EnrollmentSettings
from agent.fleet.ca.authority import DeviceAuthority
from agent.fleet.ca.claims import ClaimBundle, ClaimRefused, make_claim, verify_claim
from agent.fleet.ca.csr import CsrRefused, check_csr
from agent.fleet.ca.init_steps import init_ca
from agent.fleet.ca.layout import CaDir
from agent.mqtt.inbound import InboundMessage
from agent.mqtt.service_client import ServiceClient
from agent.mqtt.settings import MqttSettings, TlsSettings
from agent.protocol.enrollment import CertRenewal, EnrollReply, EnrollRequest, device_of_enroll_client
from agent.protocol.messages import decode, encode
from agent.protocol.topics import Topics, enroll_client_of, enroll_reply, enroll_request_filter, fleet_filter

PREFIX = "fleet/v1"


@dataclass
class FleetPki:
    """The CA directory, its authority, one claim bundle, and a broker serving both TLS listeners."""

    ca: CaDir
    authority: DeviceAuthority
    claim: ClaimBundle
    broker: Broker
    enroll_port: int
    devices_port: int

    def device_mqtt(self, device_dir: Path, **changes: object) -> MqttSettings:
        """A device's ``mqtt:`` on the devices listener; its own certificate and key in ``device_dir``."""
        tls = TlsSettings(
            ca_file=self.claim.ca_file,
            cert_file=device_dir / "device.crt",
            key_file=device_dir / "device.key",
        )
        fields: dict[str, object] = {
            "host": "127.0.0.1",
            "port": self.devices_port,
            "tls": tls,
            "reconnect_min_s": 0.2,
            "reconnect_max_s": 1.0,
        }
        return MqttSettings.model_validate(fields | changes)

    def enrollment(self, **changes: object) -> EnrollmentSettings:
        """The ``enrollment:`` section for the claim, with short waits unless ``changes`` say otherwise."""
        fields: dict[str, object] = {
            "host": "127.0.0.1",
            "port": self.enroll_port,
            "claim_cert_file": self.claim.cert_file,
            "claim_key_file": self.claim.key_file,
            "reply_timeout_s": 5.0,
            "retry_min_s": 0.2,
            "retry_max_s": 1.0,
        }
        return EnrollmentSettings.model_validate(fields | changes)

    def operator(self, handler: Callable[[InboundMessage], object]) -> ServiceClient:
        """An operator-side client on the plain loopback listener (no ACL there)."""
        settings = MqttSettings(host="127.0.0.1", port=self.broker.port)
        return ServiceClient(settings, handler=handler).start()


def make_fleet_pki(
    tmp: Path, broker_factory: Callable[[Sequence[str]], Broker], *, uses: int = 50
) -> FleetPki:
    """A new CA and claim in ``tmp``, and a started broker with both TLS listeners."""
    done = init_ca(tmp / "root", tmp / "ca", ("127.0.0.1", "localhost"))
    claim = make_claim(done.ca.path, "batch-1", uses=uses, days=2, out_dir=tmp / "claim")
    acl = tmp / "broker.acl"
    enroll_port, devices_port = free_port(), free_port()
    # One ACL for every listener (mosquitto 2.0's per_listener_settings must precede every listener,
    # and the Broker's plain listener comes first): anonymous (the operator here) reads and writes
    # the tree; a claim its enrollment topics; a device its own tree.
    acl.write_text(
        f"topic readwrite {PREFIX}/#\n"
        f"pattern write {PREFIX}/enroll/%c/request\n"
        f"pattern read {PREFIX}/enroll/%c/reply\n"
        f"pattern write {PREFIX}/%u/up/#\n"
        f"pattern read {PREFIX}/%u/down/#\n"
    )
    server = [f"certfile {done.ca.server_cert}", f"keyfile {done.ca.server_key}"]
    broker = broker_factory(
        [
            f"acl_file {acl}",
            f"listener {enroll_port} 127.0.0.1",
            f"cafile {done.ca.claims_cert}",
            *server,
            "require_certificate true",
            "use_identity_as_username true",
            f"listener {devices_port} 127.0.0.1",
            f"cafile {done.ca.devices_trust}",
            *server,
            "require_certificate true",
            "use_identity_as_username true",
            f"crlfile {done.ca.crl}",
        ]
    )
    return FleetPki(done.ca, DeviceAuthority.load(done.ca.path), claim, broker, enroll_port, devices_port)


@dataclass
class Asked:
    """One request the desk received: where, what, and when (monotonic seconds)."""

    topic: str
    request: EnrollRequest | CertRenewal
    at: float


Decide = Callable[[EnrollRequest | CertRenewal, str], EnrollReply | None]


@dataclass
class StandInDesk:
    """Answers enrollment and renewal requests with the real CA API; a test may script the answers.

    ``decide(request, device_id)``: the reply to send (None: stay silent); by default every valid
    request is issued a certificate of ``days`` days.
    """

    pki: FleetPki
    decide: Decide | None = None
    days: int | None = None
    asked: list[Asked] = field(default_factory=list)
    sent: list[EnrollReply] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self.client = self.pki.operator(self._on_message)
        self.client.subscribe(enroll_request_filter(PREFIX), qos=1)
        self.client.subscribe(fleet_filter(PREFIX, "cert"), qos=1)

    def stop(self) -> None:
        self.client.stop()

    def requests(self) -> list[Asked]:
        with self._lock:
            return list(self.asked)

    def issue(self, request: EnrollRequest | CertRenewal, device_id: str) -> EnrollReply:
        """The real CA's answer: claim checked (enrollment), CSR checked, certificate issued."""
        try:
            if isinstance(request, EnrollRequest):
                verify_claim(
                    request.claim_cert_pem.encode(),
                    bytes.fromhex(request.claim_signature),
                    request.signed_bytes(),
                    self.pki.authority.claims_ca,
                )
            checked = check_csr(request.csr_pem.encode(), device_id)
        except (ClaimRefused, CsrRefused) as exc:
            return EnrollReply(
                request_id=request.request_id, outcome="refused", code=exc.code, message=str(exc)
            )
        issued = self.pki.authority.issue(checked, self.days)
        return EnrollReply(
            request_id=request.request_id,
            outcome="issued",
            cert_pem=issued.cert_pem.decode(),
            chain_pem=issued.chain_pem.decode(),
        )

    def send(self, topic: str, reply: EnrollReply) -> None:
        with self._lock:
            self.sent.append(reply)
        self.client.publish(topic, encode(reply), qos=1)

    def _on_message(self, message: InboundMessage) -> None:
        request: EnrollRequest | CertRenewal
        if message.topic.endswith("/request"):
            client_id = enroll_client_of(message.topic, PREFIX)
            device_id = device_of_enroll_client(client_id) or ""
            request = decode(EnrollRequest, message.payload)
            reply_topic = enroll_reply(PREFIX, client_id)
        else:
            device_id = message.topic.split("/")[-3]
            request = decode(CertRenewal, message.payload)
            reply_topic = Topics(PREFIX, device_id).cert_reply
        with self._lock:
            self.asked.append(Asked(message.topic, request, time.monotonic()))
        decide = self.decide or self.issue
        reply = decide(request, device_id)
        if reply is not None:
            self.send(reply_topic, reply)
