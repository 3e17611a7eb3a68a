"""Claims: ``fleet ca claim``'s bundle and verify_claim's refusals, with keys made in the test."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from agent.errors import UsageError
from agent.fleet.ca.claims import ClaimRefused, make_claim, read_claims, verify_claim
from agent.fleet.ca.init_steps import ROOT_CN
from agent.fleet.ca.pki import leaf_certificate, now, pem, read_cert, read_key
from tests.fleet.ca.ca_rig import make_ca

REQUEST = b'{"device_id":"jet-1","csr":"..."}'


def sign(key_file: Path, data: bytes) -> bytes:
    key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return key.sign(data, ec.ECDSA(hashes.SHA256()))


def test_a_claim_bundle_has_the_cert_a_0600_key_and_the_device_root(tmp_path: Path) -> None:
    ca = make_ca(tmp_path).ca
    bundle = make_claim(ca.path, "batch-7", uses=50, days=14, out_dir=tmp_path / "claim")
    assert bundle.key_file.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "claim").stat().st_mode & 0o777 == 0o700
    assert read_cert(bundle.ca_file).subject.rfc4514_string() == f"CN={ROOT_CN}"
    cert = read_cert(bundle.cert_file)
    assert cert.subject.rfc4514_string() == "CN=claim:batch-7"
    assert read_claims(ca.path)["batch-7"].uses == 50
    assert read_claims(ca.path)["batch-7"].not_after == cert.not_valid_after_utc
    proof = verify_claim(
        bundle.cert_file.read_bytes(), sign(bundle.key_file, REQUEST), REQUEST, read_cert(ca.claims_cert)
    )
    assert (proof.name, proof.serial) == ("batch-7", f"{cert.serial_number:x}")


def test_a_claim_name_is_used_once(tmp_path: Path) -> None:
    ca = make_ca(tmp_path).ca
    make_claim(ca.path, "batch-7", uses=1, days=1, out_dir=tmp_path / "a")
    with pytest.raises(UsageError, match="exists already"):
        make_claim(ca.path, "batch-7", uses=1, days=1, out_dir=tmp_path / "b")
    with pytest.raises(UsageError, match="claim name"):
        make_claim(ca.path, "batch/8", uses=1, days=1, out_dir=tmp_path / "c")


def test_a_request_signed_by_another_key_is_bad_claim_signature(tmp_path: Path) -> None:
    ca = make_ca(tmp_path).ca
    bundle = make_claim(ca.path, "batch-7", uses=5, days=14, out_dir=tmp_path / "claim")
    other = ec.generate_private_key(ec.SECP256R1()).sign(REQUEST, ec.ECDSA(hashes.SHA256()))
    claims_ca = read_cert(ca.claims_cert)
    for signature, data in ((other, REQUEST), (sign(bundle.key_file, REQUEST), REQUEST + b" ")):
        with pytest.raises(ClaimRefused) as caught:
            verify_claim(bundle.cert_file.read_bytes(), signature, data, claims_ca)
        assert caught.value.code == "bad_claim_signature"


def test_a_device_certificate_or_garbage_is_bad_claim(tmp_path: Path) -> None:
    ca = make_ca(tmp_path).ca
    claims_ca = read_cert(ca.claims_cert)
    # The server certificate is signed by the device root, not the claims CA.
    for not_a_claim in (ca.server_cert.read_bytes(), b"garbage", b"x" * 9000):
        with pytest.raises(ClaimRefused) as caught:
            verify_claim(not_a_claim, b"sig", REQUEST, claims_ca)
        assert caught.value.code == "bad_claim"


def refused_claim(tmp_path: Path, cn: str, life: datetime.timedelta) -> str:
    """The code verify_claim refuses a claims CA certificate for ``cn``, valid until ``life`` from now."""
    ca = make_ca(tmp_path).ca
    claims_ca, claims_key = read_cert(ca.claims_cert), read_key(ca.claims_key)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = leaf_certificate(cn, key.public_key(), claims_key, claims_ca, now() + life)
    signature = key.sign(REQUEST, ec.ECDSA(hashes.SHA256()))
    with pytest.raises(ClaimRefused) as caught:
        verify_claim(pem(cert), signature, REQUEST, claims_ca)
    return caught.value.code


def test_an_expired_claim_is_claim_expired(tmp_path: Path) -> None:
    assert refused_claim(tmp_path, "claim:old", -datetime.timedelta(minutes=1)) == "claim_expired"


def test_a_certificate_of_the_claims_ca_without_a_claim_name_is_bad_claim(tmp_path: Path) -> None:
    assert refused_claim(tmp_path, "jet-1", datetime.timedelta(days=1)) == "bad_claim"


def test_a_claim_of_another_fleet_is_bad_claim(tmp_path: Path) -> None:
    ours, theirs = make_ca(tmp_path / "ours").ca, make_ca(tmp_path / "theirs").ca
    bundle = make_claim(theirs.path, "batch-7", uses=5, days=14, out_dir=tmp_path / "their-claim")
    # Same claims CA name, same claim name: only the signature tells them apart.
    assert read_cert(theirs.claims_cert).subject == read_cert(ours.claims_cert).subject
    signature = sign(bundle.key_file, REQUEST)
    with pytest.raises(ClaimRefused) as caught:
        verify_claim(bundle.cert_file.read_bytes(), signature, REQUEST, read_cert(ours.claims_cert))
    assert caught.value.code == "bad_claim"
