"""``fleet ca init`` and ``fleet ca intermediate``: the fleet's CA made, as a row of small steps.

The root is made in its own directory, which the operator moves off the controller host: it signs
only the devices intermediate (re-certified every :data:`INTERMEDIATE_DAYS` with the same key, so
the certificates and the CRL it signed stay valid) and the broker's server certificate. The
controller's CA directory gets the intermediate, the claims CA (a separate root: the enrollment
listener trusts it, the devices listener does not), the broker's certificate and an empty CRL.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes

from agent.errors import UsageError
from agent.fleet.ca.broker import BrokerSettings, write_broker_settings, write_devices_acl
from agent.fleet.ca.crl import write_crl
from agent.fleet.ca.layout import CaDir, RootDir, make_private_dir
from agent.fleet.ca.pki import (
    ca_certificate,
    leaf_certificate,
    new_key,
    now,
    read_cert,
    read_key,
    write_cert,
    write_key,
)

ROOT_DAYS = 3650
#: The devices intermediate's life: short, so a controller host's key that leaks expires soon.
INTERMEDIATE_DAYS = 90
CLAIMS_CA_DAYS = 3650
SERVER_DAYS = 825

#: The CA directory may be traversed (not listed) so the broker reaches ``broker/``, which it reads.
CA_DIR_MODE = 0o711
BROKER_DIR_MODE = 0o755

ROOT_CN = "edge-agent fleet device root"
INTERMEDIATE_CN = "edge-agent fleet devices"
CLAIMS_CN = "edge-agent fleet claims"


@dataclass(frozen=True)
class InitDone:
    """What ``fleet ca init`` made."""

    root: RootDir
    ca: CaDir
    intermediate_not_after: datetime.datetime


def init_ca(
    root_dir: Path,
    ca_dir: Path,
    server_names: tuple[str, ...],
    *,
    intermediate_days: int = INTERMEDIATE_DAYS,
    broker: BrokerSettings | None = None,
) -> InitDone:
    """Make the root, the devices intermediate, the claims CA, the broker's certificate, the CRL
    and the devices ACL; record ``broker`` (the topic prefix, the local broker's pid file)."""
    root, ca = RootDir(Path(root_dir)), CaDir(Path(ca_dir))
    if root.path.resolve() == ca.path.resolve():
        raise UsageError("--root-dir and --ca-dir must differ: the root directory leaves the controller host")
    for existing in (root.key, ca.devices_key, ca.claims_key):
        if existing.exists():
            raise UsageError(
                f"{existing} exists already: this CA was made; renew with `fleet ca intermediate`"
            )
    if not server_names:
        raise UsageError("name the broker's host with --broker-host (repeat it for each name or IP)")
    make_private_dir(root.path)
    make_private_dir(ca.path, CA_DIR_MODE)
    make_private_dir(ca.broker_dir, BROKER_DIR_MODE)
    root_cert = _make_root(root)
    write_cert(ca.root_cert, root_cert)
    _make_server_cert(ca, root_cert, read_key(root.key), server_names)
    _make_claims_ca(ca)
    write_key(ca.devices_key, new_key())
    intermediate = certify_intermediate(root, ca, intermediate_days)
    write_crl(ca.crl, [], intermediate, read_key(ca.devices_key))
    write_broker_settings(ca, broker or BrokerSettings())
    write_devices_acl(ca, [])
    return InitDone(root, ca, intermediate.not_valid_after_utc)


def certify_intermediate(root: RootDir, ca: CaDir, days: int = INTERMEDIATE_DAYS) -> x509.Certificate:
    """Certify the devices intermediate's key with the root for ``days``; rewrite the broker's trust file.

    The key stays the same, so device certificates and the CRL signed before stay valid under the
    new certificate (same subject, same key identifier).
    """
    if not root.key.exists():
        raise UsageError(
            f"{root.key} not found: renewing the intermediate needs the root directory (--root-dir)"
        )
    root_cert, root_key = read_cert(root.cert), read_key(root.key)
    key = read_key(ca.devices_key)
    cert = ca_certificate(INTERMEDIATE_CN, key.public_key(), root_key, root_cert, days, path_length=0)
    write_cert(ca.devices_cert, cert)
    write_cert(ca.devices_trust, cert, root_cert)
    return cert


def _make_root(root: RootDir) -> x509.Certificate:
    key = new_key()
    write_key(root.key, key)
    cert = ca_certificate(ROOT_CN, key.public_key(), key, None, ROOT_DAYS, path_length=1)
    write_cert(root.cert, cert)
    return cert


def _make_claims_ca(ca: CaDir) -> None:
    key = new_key()
    write_key(ca.claims_key, key)
    write_cert(
        ca.claims_cert, ca_certificate(CLAIMS_CN, key.public_key(), key, None, CLAIMS_CA_DAYS, path_length=0)
    )


def _make_server_cert(
    ca: CaDir, root_cert: x509.Certificate, root_key: CertificateIssuerPrivateKeyTypes, names: tuple[str, ...]
) -> None:
    key = new_key()
    write_key(ca.server_key, key)
    not_after = now() + datetime.timedelta(days=SERVER_DAYS)
    cert = leaf_certificate(names[0], key.public_key(), root_key, root_cert, not_after, server_names=names)
    write_cert(ca.server_cert, cert)
