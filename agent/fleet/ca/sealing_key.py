"""A device's public key to seal a secret to: its enrollment certificate, checked against the ledger.

The ledger keeps each issued certificate's key fingerprint, not the certificate: the operator hands
the certificate in (the device's ``mqtt.tls.cert_file``, or the one ``fleet ca`` issued), and it is
taken only when it names the device and its key is one the CA issued to that device, unrevoked and
unexpired. A secret sealed to any other key would open elsewhere, or nowhere.
"""

from __future__ import annotations

from pathlib import Path

from cryptography.hazmat.primitives.asymmetric import ec

from agent.errors import ConfigError
from agent.fleet.ca.ledger import IssuedLedger
from agent.fleet.ca.pki import cn_of, key_fingerprint, now, read_cert


def device_sealing_key(
    cert_file: Path, device_id: str, ledger: IssuedLedger | None
) -> ec.EllipticCurvePublicKey:
    """The P-256 key of ``cert_file`` for ``device_id`` (ConfigError saying why it is not one to seal to).

    ``ledger`` None (no CA on this machine): the certificate's name and key type are checked only.
    """
    cert = read_cert(cert_file)
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
