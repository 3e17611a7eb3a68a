"""The online half of the device CA: the devices intermediate the controller holds, signing devices'
certificates from checked CSRs, recording them, revoking them and keeping the CRL.

The root key is not here (it stays in the offline root directory); the intermediate has a short
life and is re-certified from the root with ``edge-agent fleet ca intermediate``. A device
certificate never outlives the intermediate that signed it.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

import structlog
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes

from agent.errors import ConfigError
from agent.fleet.ca.broker import BrokerTold, tell_broker, write_devices_acl
from agent.fleet.ca.crl import crl_due, write_crl
from agent.fleet.ca.csr import CheckedCsr
from agent.fleet.ca.layout import CaDir
from agent.fleet.ca.ledger import IssuedLedger, IssuedRecord
from agent.fleet.ca.pki import leaf_certificate, now, pem, read_cert, read_key, serial_text

log = structlog.get_logger(__name__)

#: A device certificate's life unless the caller asks for another; devices renew at two thirds.
DEFAULT_DEVICE_DAYS = 30
#: The longest life a device certificate may be given.
MAX_DEVICE_DAYS = 365


@dataclass(frozen=True)
class Issued:
    """A device certificate just signed: the certificate, the chain up to (not including) the root,
    its serial (lower-case hex) and its expiry."""

    cert_pem: bytes
    chain_pem: bytes
    serial: str
    not_after: datetime.datetime


class DeviceAuthority:
    """The devices intermediate and its ledger, as loaded from the controller's CA directory."""

    def __init__(
        self,
        ca_dir: CaDir,
        cert: x509.Certificate,
        key: CertificateIssuerPrivateKeyTypes,
        claims_ca: x509.Certificate,
    ) -> None:
        self._dir = ca_dir
        self._ledger = IssuedLedger(ca_dir.issued)
        self._cert = cert
        self._key = key
        self.claims_ca = claims_ca
        """The claims CA's certificate, for :func:`agent.fleet.ca.claims.verify_claim`."""

    @classmethod
    def load(cls, ca_dir: Path) -> DeviceAuthority:
        """Load the CA directory ``fleet ca init`` made; re-issue the CRL if half its life is gone."""
        layout = CaDir(Path(ca_dir))
        if not layout.devices_cert.exists():
            raise ConfigError(f"{ca_dir} holds no device CA; make it with `edge-agent fleet ca init`")
        authority = cls(
            layout,
            read_cert(layout.devices_cert),
            read_key(layout.devices_key),
            read_cert(layout.claims_cert),
        )
        authority.renew_crl_if_due()
        return authority

    @property
    def crl_path(self) -> Path:
        """The CRL file: what the broker's devices listener names as ``crlfile``."""
        return self._dir.crl

    @property
    def not_after(self) -> datetime.datetime:
        """When the devices intermediate expires (no device certificate lives longer)."""
        return self._cert.not_valid_after_utc

    def issue(self, checked: CheckedCsr, days: int | None = None) -> Issued:
        """Sign ``checked``'s key for its device id for ``days`` (default :data:`DEFAULT_DEVICE_DAYS`)."""
        days = DEFAULT_DEVICE_DAYS if days is None else days
        if not 1 <= days <= MAX_DEVICE_DAYS:
            raise ValueError(f"a device certificate lives 1-{MAX_DEVICE_DAYS} days, not {days}")
        if self.not_after <= now():
            raise ConfigError(
                f"the devices intermediate expired at {self.not_after:%Y-%m-%d %H:%M} UTC; "
                "renew it with `edge-agent fleet ca intermediate` (needs the root directory)"
            )
        cert = leaf_certificate(
            checked.device_id,
            checked.public_key,
            self._key,
            self._cert,
            now() + datetime.timedelta(days=days),
        )
        serial = serial_text(cert.serial_number)
        record = IssuedRecord(
            serial=serial,
            device_id=checked.device_id,
            fingerprint=checked.fingerprint,
            issued_at=now(),
            not_after=cert.not_valid_after_utc,
            cert_pem=pem(cert).decode("ascii"),
        )
        was_denied = self._ledger.is_denied(checked.device_id)
        self._ledger.add(record)
        if was_denied:
            # The device had been revoked and is enrolled again: the broker must drop its deny block.
            with self._dir.locked():
                write_devices_acl(self._dir, self._ledger.denied_devices())
            self.tell_broker()
        log.info(
            "fleet.ca.issued", device=checked.device_id, serial=serial, not_after=record.not_after.isoformat()
        )
        return Issued(pem(cert), pem(self._cert), serial, cert.not_valid_after_utc)

    def certificates_of(self, device_id: str) -> list[IssuedRecord]:
        """The ledger's records for ``device_id``, oldest first (revoked ones included)."""
        return self._ledger.of_device(device_id)

    def revoke_device(self, device_id: str, reason: str, *, tell: bool = True) -> list[str]:
        """Revoke every unexpired certificate of ``device_id``; the serials revoked.

        The CRL and the devices ACL are rewritten (temp + fsync + rename) even when nothing new was
        revoked, so a revocation always leaves them current; then the broker is told to reload
        them (``tell``; the CLI passes False and calls :meth:`tell_broker` to print the outcome).
        """
        with self._dir.locked():
            revoked = self._ledger.revoke(device_id, reason)
            self._write_crl()
            write_devices_acl(self._dir, self._ledger.denied_devices())
        log.info("fleet.ca.revoked", device=device_id, serials=revoked, reason=reason)
        if tell:
            self.tell_broker()
        return revoked

    def tell_broker(self) -> BrokerTold:
        """Tell the local broker to re-read the CRL and the devices ACL (see :mod:`agent.fleet.ca.broker`)."""
        return tell_broker(self._dir)

    def renew_crl_if_due(self) -> bool:
        """Re-issue the CRL when it is missing or past half its life, and tell the broker (which
        keeps the CRL it read in memory until told); whether it was re-issued."""
        with self._dir.locked():
            if not crl_due(self._dir.crl):
                return False
            self._write_crl()
        log.info("fleet.ca.crl_renewed", path=str(self._dir.crl))
        self.tell_broker()
        return True

    def reissue_crl(self) -> Path:
        """Re-issue the CRL and the devices ACL now (``fleet ca crl``; the caller tells the broker)."""
        with self._dir.locked():
            self._write_crl()
            write_devices_acl(self._dir, self._ledger.denied_devices())
        return self._dir.crl

    def _write_crl(self) -> None:
        write_crl(self._dir.crl, self._ledger.revoked(), self._cert, self._key)
