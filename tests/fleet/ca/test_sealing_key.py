"""The key a secret is sealed to: a device's certificate, taken only when the CA issued it that key."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from pydantic import ValidationError

from agent.errors import ConfigError
from agent.fleet.ca.authority import DeviceAuthority
from agent.fleet.ca.ledger import MAX_CERT_PEM, IssuedLedger, IssuedRecord
from agent.fleet.ca.pki import now
from agent.fleet.ca.sealing_key import device_sealing_key
from tests.fleet.ca.ca_rig import device_key_and_csr, make_ca


def test_only_the_devices_current_certificate_gives_the_key(tmp_path: Path) -> None:
    done = make_ca(tmp_path)
    authority = DeviceAuthority.load(done.ca.path)
    key, checked = device_key_and_csr("jet-1")
    cert = tmp_path / "jet-1.crt"
    cert.write_bytes(authority.issue(checked).cert_pem)
    ledger = IssuedLedger(done.ca.issued)
    sealing = device_sealing_key(cert, "jet-1", ledger)
    assert sealing.public_numbers() == key.public_key().public_numbers()

    with pytest.raises(ConfigError, match="'jet-1''s, not 'jet-2''s"):
        device_sealing_key(cert, "jet-2", ledger)

    authority.revoke_device("jet-1", "lost", tell=False)
    with pytest.raises(ConfigError, match="no current certificate for this key"):
        device_sealing_key(cert, "jet-1", ledger)


def test_a_certificate_another_ca_issued_is_refused(tmp_path: Path) -> None:
    ours = make_ca(tmp_path / "ours")
    theirs = DeviceAuthority.load(make_ca(tmp_path / "theirs").ca.path)
    cert = tmp_path / "jet-1.crt"
    cert.write_bytes(theirs.issue(device_key_and_csr("jet-1")[1]).cert_pem)
    with pytest.raises(ConfigError, match="no current certificate"):
        device_sealing_key(cert, "jet-1", IssuedLedger(ours.ca.issued))


def test_with_no_certificate_given_the_ledger_gives_the_devices_current_one(tmp_path: Path) -> None:
    done = make_ca(tmp_path)
    authority = DeviceAuthority.load(done.ca.path)
    ledger = IssuedLedger(done.ca.issued)
    first, checked = device_key_and_csr("jet-1")
    authority.issue(checked)
    assert device_sealing_key(None, "jet-1", ledger).public_numbers() == first.public_key().public_numbers()

    renewed, checked = device_key_and_csr("jet-1")  # a new key: the newest certificate is the current one
    authority.issue(checked)
    assert device_sealing_key(None, "jet-1", ledger).public_numbers() == renewed.public_key().public_numbers()

    with pytest.raises(ConfigError, match="no current certificate of 'jet-2'"):
        device_sealing_key(None, "jet-2", ledger)
    authority.revoke_device("jet-1", "lost", tell=False)
    with pytest.raises(ConfigError, match="no current certificate of 'jet-1'"):
        device_sealing_key(None, "jet-1", ledger)


def test_a_ledger_made_before_it_kept_certificates_is_migrated_and_keeps_its_records(tmp_path: Path) -> None:
    done = make_ca(tmp_path)
    authority = DeviceAuthority.load(done.ca.path)
    old_key, checked = device_key_and_csr("jet-1")
    authority.issue(checked)
    # The ledger as the previous version wrote it: no certificate column, the record's fingerprint only.
    with sqlite3.connect(done.ca.issued) as db:
        db.execute(
            "CREATE TABLE old AS SELECT serial, device_id, fingerprint, issued_at, not_after, "
            "revoked_at, reason FROM certificates"
        )
        db.execute("DROP TABLE certificates")
        db.execute("ALTER TABLE old RENAME TO certificates")
    ledger = IssuedLedger(done.ca.issued)
    [record] = ledger.of_device("jet-1")
    assert record.cert_pem is None
    with pytest.raises(ConfigError, match="issued before the ledger kept certificates"):
        device_sealing_key(None, "jet-1", ledger)
    cert = tmp_path / "jet-1.crt"  # the certificate handed in still works, checked by its fingerprint
    cert.write_bytes(authority.issue(checked).cert_pem)
    assert device_sealing_key(cert, "jet-1", ledger).public_numbers() == old_key.public_key().public_numbers()
    assert device_sealing_key(None, "jet-1", ledger).public_numbers() == old_key.public_key().public_numbers()
    serials = [r.serial for r in ledger.of_device("jet-1")]
    assert len(serials) == 2
    assert serials[0] == record.serial


def test_a_certificate_larger_than_the_ledger_keeps_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="cert_pem"):
        IssuedRecord(
            serial="1",
            device_id="jet-1",
            fingerprint="00",
            issued_at=now(),
            not_after=now(),
            cert_pem="x" * (MAX_CERT_PEM + 1),
        )
