"""DeviceAuthority: the CA ``fleet ca init`` makes, device certificates issued, recorded and revoked."""

from __future__ import annotations

import datetime
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from agent.errors import ConfigError, UsageError
from agent.fleet.ca.authority import DeviceAuthority
from agent.fleet.ca.crl import crl_due, read_crl
from agent.fleet.ca.init_steps import certify_intermediate
from agent.fleet.ca.layout import CaDir
from agent.fleet.ca.ledger import IssuedLedger, IssuedRecord
from agent.fleet.ca.pki import now
from tests.fleet.ca.ca_rig import device_key_and_csr, make_ca
from tests.waiting import patient


def openssl_verify(
    ca_file: Path, cert_pem: bytes, tmp: Path, *extra: str
) -> subprocess.CompletedProcess[str]:
    cert = tmp / "leaf.pem"
    cert.write_bytes(cert_pem)
    return subprocess.run(
        ["openssl", "verify", "-CAfile", str(ca_file), *extra, str(cert)],
        capture_output=True,
        text=True,
        check=False,
    )


def test_init_keeps_keys_0600_and_the_root_key_out_of_the_ca_dir(tmp_path: Path) -> None:
    done = make_ca(tmp_path)
    ca = done.ca
    for key in (done.root.key, ca.devices_key, ca.claims_key, ca.server_key):
        assert key.stat().st_mode & 0o777 == 0o600, key
    assert done.root.path.stat().st_mode & 0o777 == 0o700
    assert ca.path.stat().st_mode & 0o777 == 0o711  # traversable by the broker, never listed
    assert ca.broker_dir.stat().st_mode & 0o777 == 0o755
    for readable_by_the_broker in (ca.crl, ca.devices_acl, ca.devices_trust, ca.claims_cert, ca.server_cert):
        assert readable_by_the_broker.parent == ca.broker_dir
        assert readable_by_the_broker.stat().st_mode & 0o777 == 0o644, readable_by_the_broker
    assert not any(p.name == "root.key" for p in ca.path.rglob("*"))
    assert read_crl(ca.crl) is not None
    assert datetime.timedelta(days=80) < done.intermediate_not_after - now() <= datetime.timedelta(days=90)


def test_init_refuses_to_overwrite_a_ca(tmp_path: Path) -> None:
    make_ca(tmp_path)
    with pytest.raises(UsageError, match="exists already"):
        make_ca(tmp_path)


def test_a_device_certificate_chains_to_the_root_with_the_device_id_as_cn(tmp_path: Path) -> None:
    ca = make_ca(tmp_path).ca
    authority = DeviceAuthority.load(ca.path)
    _, checked = device_key_and_csr("jet-1")
    issued = authority.issue(checked)
    cert = x509.load_pem_x509_certificate(issued.cert_pem)
    assert cert.subject.rfc4514_string() == "CN=jet-1"
    assert f"{cert.serial_number:x}" == issued.serial
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert datetime.timedelta(days=29) < issued.not_after - now() <= datetime.timedelta(days=30)
    untrusted = tmp_path / "chain.pem"
    untrusted.write_bytes(issued.chain_pem)
    verified = openssl_verify(ca.root_cert, issued.cert_pem, tmp_path, "-untrusted", str(untrusted))
    assert verified.returncode == 0, verified.stderr
    assert openssl_verify(ca.devices_trust, issued.cert_pem, tmp_path).returncode == 0
    (record,) = authority.certificates_of("jet-1")
    assert (record.serial, record.fingerprint) == (issued.serial, checked.fingerprint)


def test_a_device_certificate_never_outlives_the_intermediate(tmp_path: Path) -> None:
    ca = make_ca(tmp_path).ca
    authority = DeviceAuthority.load(ca.path)
    issued = authority.issue(device_key_and_csr("jet-1")[1], days=365)
    assert issued.not_after == authority.not_after


def test_revoking_lists_every_certificate_of_that_device_and_no_other(tmp_path: Path) -> None:
    ca = make_ca(tmp_path).ca
    authority = DeviceAuthority.load(ca.path)
    first = authority.issue(device_key_and_csr("jet-1")[1])
    renewed = authority.issue(device_key_and_csr("jet-1")[1])
    other = authority.issue(device_key_and_csr("jet-2")[1])
    assert sorted(authority.revoke_device("jet-1", "stolen")) == sorted([first.serial, renewed.serial])
    assert authority.revoke_device("jet-1", "stolen") == []
    crl = read_crl(authority.crl_path)
    assert crl is not None
    assert {f"{r.serial_number:x}" for r in crl} == {first.serial, renewed.serial}
    root_and_crl = tmp_path / "trust-and-crl.pem"
    root_and_crl.write_bytes(ca.devices_trust.read_bytes() + authority.crl_path.read_bytes())
    revoked = openssl_verify(root_and_crl, renewed.cert_pem, tmp_path, "-crl_check")
    assert "certificate revoked" in revoked.stdout + revoked.stderr
    assert openssl_verify(root_and_crl, other.cert_pem, tmp_path, "-crl_check").returncode == 0


def test_the_ledger_forgets_certificates_long_expired(tmp_path: Path) -> None:
    ca = make_ca(tmp_path).ca
    ledger = IssuedLedger(ca.issued)
    long_ago = now() - datetime.timedelta(days=40)
    ledger.add(
        IssuedRecord(
            serial="abc",
            device_id="jet-old",
            fingerprint="00",
            issued_at=long_ago,
            not_after=long_ago + datetime.timedelta(days=30),
            revoked_at=long_ago,
            reason="test",
        )
    )
    assert ledger.of_device("jet-old") == []  # dropped by the same write
    assert ledger.revoked() == []
    assert ca.issued.stat().st_mode & 0o777 == 0o600


def test_issuing_in_two_processes_at_once_loses_no_record(tmp_path: Path) -> None:
    ca = make_ca(tmp_path).ca
    script = (
        "import sys; from agent.fleet.ca.authority import DeviceAuthority; "
        "from tests.fleet.ca.ca_rig import device_key_and_csr; "
        "a = DeviceAuthority.load(sys.argv[1]); "
        "[a.issue(device_key_and_csr(f'{sys.argv[2]}-{i}')[1]) for i in range(15)]"
    )
    workers = [
        subprocess.Popen([sys.executable, "-c", script, str(ca.path), name], cwd=Path(__file__).parents[3])
        for name in ("left", "right")
    ]
    assert [w.wait(timeout=patient(120)) for w in workers] == [0, 0]
    authority = DeviceAuthority.load(ca.path)
    assert all(
        len(authority.certificates_of(f"{side}-{i}")) == 1 for side in ("left", "right") for i in range(15)
    )


def test_a_crl_past_half_its_life_is_reissued_on_load(tmp_path: Path) -> None:
    ca = make_ca(tmp_path).ca
    crl = read_crl(ca.crl)
    assert crl is not None
    assert not crl_due(ca.crl)
    assert crl.next_update_utc is not None
    assert crl_due(ca.crl, at=crl.next_update_utc - datetime.timedelta(days=1))
    ca.crl.write_bytes(b"damaged")
    DeviceAuthority.load(ca.path)
    assert read_crl(ca.crl) is not None


def test_a_renewed_intermediate_keeps_earlier_device_certificates_valid(tmp_path: Path) -> None:
    done = make_ca(tmp_path)
    authority = DeviceAuthority.load(done.ca.path)
    before = authority.issue(device_key_and_csr("jet-1")[1])
    old_intermediate = done.ca.devices_cert.read_bytes()
    certify_intermediate(done.root, done.ca, days=120)
    assert done.ca.devices_cert.read_bytes() != old_intermediate
    assert openssl_verify(done.ca.devices_trust, before.cert_pem, tmp_path).returncode == 0
    assert datetime.timedelta(days=119) < DeviceAuthority.load(done.ca.path).not_after - now()


def test_renewing_the_intermediate_without_the_root_says_what_is_missing(tmp_path: Path) -> None:
    done = make_ca(tmp_path)
    done.root.key.unlink()
    with pytest.raises(UsageError, match="root directory"):
        certify_intermediate(done.root, done.ca)


def test_loading_a_directory_without_a_ca_names_the_command(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="fleet ca init"):
        DeviceAuthority.load(tmp_path)
    assert CaDir(tmp_path).crl == tmp_path / "broker" / "devices.crl"
