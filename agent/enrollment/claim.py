"""The claim: a batch's bootstrap certificate and key, used only to ask for the device's own.

The claim key signs :meth:`~agent.protocol.enrollment.EnrollRequest.signed_bytes` (ECDSA-SHA256,
hex of the DER) so the controller knows which claim a request spends; the broker's enrollment
listener lets the claim publish nothing but that request.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from agent.enrollment.keys import load_key
from agent.errors import ConfigError
from agent.protocol.enrollment import EnrollRequest


@dataclass(frozen=True)
class Claim:
    """The claim certificate (PEM text, sent with each request) and its key (kept)."""

    cert_pem: str
    key: ec.EllipticCurvePrivateKey

    @classmethod
    def load(cls, cert_file: Path, key_file: Path) -> Claim:
        """Read the claim; ConfigError naming the ``enrollment.*`` key whose file is wrong."""
        try:
            cert_pem = cert_file.read_text(encoding="ascii")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"enrollment.claim_cert_file: cannot read {cert_file} ({exc})") from exc
        if "-----BEGIN CERTIFICATE-----" not in cert_pem:
            raise ConfigError(f"enrollment.claim_cert_file: {cert_file} holds no PEM certificate")
        return cls(cert_pem=cert_pem, key=load_key(key_file, "enrollment.claim_key_file"))

    def sign(self, data: bytes) -> str:
        """The claim key's ECDSA-SHA256 signature over ``data``, hex of the DER."""
        return self.key.sign(data, ec.ECDSA(hashes.SHA256())).hex()

    def request(self, device_id: str, csr_pem: str, serial: str | None) -> EnrollRequest:
        """A signed request for ``device_id`` with a fresh request id."""
        request = EnrollRequest(
            device_id=device_id,
            request_id=secrets.token_hex(8),
            serial=serial,
            csr_pem=csr_pem,
            claim_cert_pem=self.cert_pem,
            claim_signature="00",  # replaced below: the signature covers every other field
        )
        return request.model_copy(update={"claim_signature": self.sign(request.signed_bytes())})
