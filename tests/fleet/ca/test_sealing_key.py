"""The key a secret is sealed to: a device's certificate, taken only when the CA issued it that key."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.errors import ConfigError
from agent.fleet.ca.authority import DeviceAuthority
from agent.fleet.ca.ledger import IssuedLedger
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
