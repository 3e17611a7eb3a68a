"""A fleet CA, claims and a real controller process with its enrollment desk on, and devices that
enroll the way an agent does (a P-256 key made here, its CSR, the request signed by the claim key),
over a real mosquitto (plain TCP: the broker's TLS listeners and ACLs are shown by tests/fleet/ca).
No tests here."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes
from cryptography.x509.oid import NameOID

from agent.demo.broker import Broker
from agent.fleet.ca.claims import ClaimBundle, make_claim
from agent.fleet.ca.init_steps import InitDone
from agent.fleet.controller.client import ControllerClient
from agent.protocol.enrollment import CertRenewal, EnrollRequest, enroll_client_id, signed_request_bytes
from agent.protocol.messages import encode
from agent.protocol.topics import Topics, enroll_reply, enroll_request
from tests.fleet.ca.ca_rig import make_ca
from tests.fleet.controller_process import ControllerProcess
from tests.fleet.operator_side import operator_settings, unique_prefix
from tests.mqtt_probe import Probe
from tests.postgres_server import PostgresServer


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def csr_pem(key: CertificateIssuerPrivateKeyTypes, common_name: str) -> str:
    """A PKCS#10 request for ``common_name`` signed by ``key``."""
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM).decode()


def weak_rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=1024)


def signed_request(
    device_id: str,
    claim: ClaimBundle,
    csr: str,
    *,
    serial: str | None = None,
    request_id: str | None = None,
) -> EnrollRequest:
    """An :class:`EnrollRequest` as the agent sends it: signed by the claim's key."""
    fields: dict[str, Any] = {
        "device_id": device_id,
        "request_id": request_id or uuid.uuid4().hex[:16],
        "serial": serial,
        "csr_pem": csr,
        "claim_cert_pem": claim.cert_file.read_text(),
    }
    draft = EnrollRequest.model_construct(**fields)
    fields["msg_id"], fields["ts"] = draft.msg_id, draft.ts
    key = serialization.load_pem_private_key(claim.key_file.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    signature = key.sign(signed_request_bytes(fields), ec.ECDSA(hashes.SHA256()))
    return EnrollRequest(**fields, claim_signature=signature.hex())


@dataclass
class EnrollRig:
    """The CA, the controller (enrollment on) and a probe that sees every reply."""

    tmp: Path
    broker: Broker
    ca: InitDone
    controller: ControllerProcess
    prefix: str
    probe: Probe
    claims: dict[str, ClaimBundle] = field(default_factory=dict)

    def claim(self, name: str = "batch-1", *, uses: int = 100, days: int = 30) -> ClaimBundle:
        if name not in self.claims:
            bundle = make_claim(
                self.ca.ca.path, name, uses=uses, days=days, out_dir=self.tmp / "claims" / name
            )
            self.claims[name] = bundle
        return self.claims[name]

    def send(self, client: str, payload: bytes) -> None:
        """Publish ``payload`` as the enrollment request of client id ``client``."""
        self.probe.publish(enroll_request(self.prefix, client), payload)

    def ask(
        self, request: EnrollRequest, *, client: str | None = None, timeout: float = 30
    ) -> dict[str, Any]:
        """Send ``request`` (as client ``enroll:{its device}``) and wait for the reply naming it."""
        client = client or enroll_client_id(request.device_id)
        self.send(client, encode(request))
        return self.reply(client, request.request_id, timeout=timeout)

    def reply(self, client: str, request_id: str, *, timeout: float = 30, nth: int = 1) -> dict[str, Any]:
        """The ``nth`` reply to ``client`` naming ``request_id`` (waits for it)."""
        return self._nth(enroll_reply(self.prefix, client), request_id, nth, timeout)

    def renew(
        self, device_id: str, csr: str, *, request_id: str | None = None, nth: int = 1
    ) -> dict[str, Any]:
        """Send a :class:`CertRenewal` on the device's ``up/cert``; its reply on ``down/cert``."""
        renewal = CertRenewal(request_id=request_id or uuid.uuid4().hex[:16], csr_pem=csr)
        topics = Topics(self.prefix, device_id)
        self.probe.publish(topics.cert_renewal, encode(renewal))
        return self._nth(topics.cert_reply, renewal.request_id, nth, 30)

    def _nth(self, topic: str, request_id: str, nth: int, timeout: float) -> dict[str, Any]:
        def found(messages: list[Any]) -> list[dict[str, Any]]:
            replies = [json.loads(m.payload) for m in messages if m.topic == topic]
            return [r for r in replies if r["request_id"] == request_id]

        self.probe.wait_for(lambda ms: len(found(ms)) >= nth, timeout)
        return found(self.probe.snapshot())[nth - 1]

    def replies(self, client: str) -> list[dict[str, Any]]:
        topic = enroll_reply(self.prefix, client)
        return [json.loads(m.payload) for m in self.probe.snapshot() if m.topic == topic]

    def operator(self, verb: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """One ``fleet devices`` request to the controller (``devices_{verb}``)."""
        with ControllerClient(operator_settings(self.broker, self.prefix), timeout=60) as client:
            return client.request(f"devices_{verb}", body or {})

    def metrics(self) -> str:
        return self.controller.get("/metrics")[1].decode()


def database_lines(postgres: PostgresServer | None, name: str | None = None) -> str:
    """controller.yaml's ``database:`` on database ``name`` (none: a fresh one) of ``postgres``
    (none: SQLite, no lines)."""
    if postgres is None:
        return ""
    url = postgres.url(name or postgres.new_database())
    return f"database: {{url: '{url}', password_file: {postgres.password_file}}}\n"


def start_rig(
    tmp: Path,
    broker: Broker,
    extra: str = "",
    *,
    token: str | None = None,
    postgres: PostgresServer | None = None,
    database: str | None = None,
) -> EnrollRig:
    """Make the CA, start the controller with ``enrollment: {ca_dir: ..., <extra>}`` (and the
    console ``token`` in its http.token_file, if given; its store in a fresh database of
    ``postgres``, or in its ``database``, if given), subscribe to every reply."""
    ca = make_ca(tmp)
    prefix = unique_prefix()
    settings = f"ca_dir: {ca.ca.path}" + (f", {extra}" if extra else "")
    controller = ControllerProcess(
        tmp, broker, prefix, extra=f"enrollment: {{{settings}}}\n{database_lines(postgres, database)}"
    )
    if token is not None:
        token_file = tmp / "console.token"
        token_file.write_text(token)
        token_file.chmod(0o600)
        config = controller.config.read_text().replace(
            "http: {port:", f"http: {{token_file: {token_file}, port:"
        )
        controller.config.write_text(config)
    controller.start()
    probe = Probe(broker.host, broker.port)
    probe.subscribe(f"{prefix}/enroll/+/reply")
    probe.subscribe(f"{prefix}/+/down/cert")
    return EnrollRig(tmp, broker, ca, controller, prefix, probe)


def running_rig(
    tmp: Path,
    broker: Broker,
    extra: str = "",
    *,
    token: str | None = None,
    postgres: PostgresServer | None = None,
) -> Iterator[EnrollRig]:
    """:func:`start_rig` for a fixture: the probe closed and the controller killed afterwards."""
    rig = start_rig(tmp, broker, extra, token=token, postgres=postgres)
    try:
        yield rig
    finally:
        rig.probe.close()
        rig.controller.kill()


def metric(text: str, name: str) -> float:
    """The value of the sample line ``name`` (with its labels, as written) in exposition ``text``."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0
