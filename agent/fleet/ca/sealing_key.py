"""A device's public key to seal a secret to: its enrollment certificate, checked against the ledger.

With the CA's ledger at hand the device's current certificate is the ledger's own (the newest one
issued to it, unrevoked and unexpired). A certificate the operator hands in (the device's
``mqtt.tls.cert_file``) is taken only when it names the device and, with a ledger, when its key is
one the CA issued to that device, unrevoked and unexpired. A secret sealed to any other key would
open elsewhere, or nowhere.
"""

from __future__ import annotations

from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from agent.errors import ConfigError
from agent.fleet.ca.ledger import IssuedLedger
from agent.fleet.ca.pki import cn_of, key_fingerprint, now, read_cert


def device_sealing_key(
    cert_file: Path | None, device_id: str, ledger: IssuedLedger | None
) -> ec.EllipticCurvePublicKey:
    """The P-256 key of ``cert_file`` for ``device_id`` (ConfigError saying why it is not one to seal to).

    ``cert_file`` None: the ledger's current certificate of the device. ``ledger`` None (no CA on this
    machine): the certificate's name and key type are checked only.
    """
    if cert_file is None:
        if ledger is None:
            raise ConfigError("no certificate to seal to: give the device's certificate or the CA's ledger")
        return _from_ledger(device_id, ledger)
    cert = read_cert(cert_file)
    return _checked(cert, str(cert_file), device_id, ledger)


def _from_ledger(device_id: str, ledger: IssuedLedger) -> ec.EllipticCurvePublicKey:
    record = ledger.current_certificate(device_id)
    if record is None or record.cert_pem is None:
        raise ConfigError(
            f"the CA's ledger holds no current certificate of {device_id!r} (never issued, revoked, expired, "
            "or issued before the ledger kept certificates); give the device's certificate"
        )
    cert = x509.load_pem_x509_certificate(record.cert_pem.encode("ascii"))
    return _checked(cert, f"the ledger's certificate {record.serial}", device_id, ledger)


def _checked(
    cert: x509.Certificate, cert_file: str, device_id: str, ledger: IssuedLedger | None
) -> ec.EllipticCurvePublicKey:
    name = cn_of(cert.subject)
    if name != device_id:
        raise ConfigError(f"{cert_file}: the certificate is {name!r}'s, not {device_id!r}'s")
    key = cert.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        raise ConfigError(f"{cert_file}: not a P-256 key; a device's enrollment key is P-256")
    if ledger is not None:
        fingerprint = key_fingerprint(key)
        at = now()
        current = [
            r
            for r in ledger.of_device(device_id)
            if r.fingerprint == fingerprint and r.revoked_at is None and r.not_after > at
        ]
        if not current:
            raise ConfigError(
                f"{cert_file}: the CA issued no current certificate for this key to {device_id!r} (revoked, "
                "expired or never issued); take the device's certificate now in use"
            )
    return key
