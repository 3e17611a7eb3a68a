"""A fleet CA made in the test's directory (``fleet ca init``'s steps) and device CSRs for it."""

from __future__ import annotations

from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from agent.fleet.ca.csr import CheckedCsr, check_csr
from agent.fleet.ca.init_steps import InitDone, init_ca


def make_ca(tmp: Path) -> InitDone:
    """A new CA: root in ``tmp/root``, the controller's directory in ``tmp/ca``, broker 127.0.0.1."""
    return init_ca(tmp / "root", tmp / "ca", ("127.0.0.1", "localhost"))


def device_key_and_csr(device_id: str) -> tuple[ec.EllipticCurvePrivateKey, CheckedCsr]:
    """A device's new P-256 key and its CSR for ``device_id``, checked."""
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, device_id)]))
        .sign(key, hashes.SHA256())
    )
    return key, check_csr(csr.public_bytes(serialization.Encoding.PEM), device_id)
