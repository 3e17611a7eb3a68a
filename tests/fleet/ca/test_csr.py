"""check_csr refuses each bad request with its code; every CSR is made in the test."""

from __future__ import annotations

import warnings

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed25519, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes
from cryptography.x509.oid import NameOID

from agent.fleet.ca.csr import MAX_CSR_BYTES, CsrRefused, check_csr
from agent.fleet.ca.pki import key_fingerprint


def make_csr(
    cn: str | None,
    key: CertificateIssuerPrivateKeyTypes | None = None,
    *,
    extra: list[x509.NameAttribute[str]] | None = None,
) -> bytes:
    """A PEM CSR for subject CN ``cn`` (None: no CN) signed by ``key`` (default: a new P-256 key)."""
    key = key or ec.generate_private_key(ec.SECP256R1())
    # The X.509 upper bound on a CN is 64 characters; a device may send a longer one all the same.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        common = (
            [x509.NameAttribute(NameOID.COMMON_NAME, cn, _validate=len(cn) <= 64)] if cn is not None else []
        )
    attributes = common + (extra or [])
    algorithm = None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256()
    csr = x509.CertificateSigningRequestBuilder().subject_name(x509.Name(attributes)).sign(key, algorithm)
    return csr.public_bytes(serialization.Encoding.PEM)


def refusal(csr_pem: bytes, device_id: str) -> CsrRefused:
    with pytest.raises(CsrRefused) as caught:
        check_csr(csr_pem, device_id)
    assert caught.value.message
    assert "\n" not in caught.value.message
    return caught.value


@pytest.mark.parametrize(
    "key",
    [
        pytest.param(lambda: ec.generate_private_key(ec.SECP256R1()), id="ec-p256"),
        pytest.param(lambda: ec.generate_private_key(ec.SECP384R1()), id="ec-p384"),
        pytest.param(lambda: rsa.generate_private_key(65537, 2048), id="rsa-2048"),
    ],
)
def test_a_request_for_its_own_id_with_an_accepted_key_passes(key: object) -> None:
    private = key()  # type: ignore[operator]
    checked = check_csr(make_csr("jet-7", private), "jet-7")
    assert checked.device_id == "jet-7"
    assert checked.fingerprint == key_fingerprint(private.public_key())


def test_a_request_for_another_device_id_is_wrong_subject() -> None:
    assert refusal(make_csr("jet-other"), "jet-7").code == "wrong_subject"


def test_a_subject_with_more_than_the_cn_is_wrong_subject() -> None:
    extra = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "acme")]
    assert refusal(make_csr("jet-7", extra=extra), "jet-7").code == "wrong_subject"
    assert refusal(make_csr(None, extra=extra), "jet-7").code == "wrong_subject"


@pytest.mark.parametrize("device_id", ["jet/7", "jet+7", "jet#7", "enroll:jet-7", "+", "#"])
def test_an_id_with_a_topic_or_client_id_character_is_bad_device_id(device_id: str) -> None:
    assert refusal(make_csr(device_id), device_id).code == "bad_device_id"
    # Asked for a good id with such a CN in the CSR: still named as a bad id, never signed.
    assert refusal(make_csr(device_id), "jet-7").code == "bad_device_id"


def test_an_empty_id_is_bad_device_id() -> None:
    assert refusal(make_csr("jet-7"), "").code == "bad_device_id"


def test_an_id_over_the_length_limit_is_bad_device_id() -> None:
    longest = "j" * 64
    assert check_csr(make_csr(longest), longest).device_id == longest
    too_long = "j" * 65
    assert refusal(make_csr(too_long), too_long).code == "bad_device_id"


def test_rsa_1024_is_weak_key() -> None:
    refused = refusal(make_csr("jet-7", rsa.generate_private_key(65537, 1024)), "jet-7")
    assert refused.code == "weak_key"
    assert "1024" in refused.message


@pytest.mark.parametrize(
    "key",
    [
        pytest.param(ed25519.Ed25519PrivateKey.generate, id="ed25519"),
        pytest.param(lambda: dsa.generate_private_key(2048), id="dsa-2048"),
        pytest.param(lambda: ec.generate_private_key(ec.SECP521R1()), id="ec-p521"),
        pytest.param(lambda: ec.generate_private_key(ec.SECP256K1()), id="ec-secp256k1"),
    ],
)
def test_a_key_of_another_kind_or_curve_is_unsupported_key(key: object) -> None:
    assert refusal(make_csr("jet-7", key()), "jet-7").code == "unsupported_key"  # type: ignore[operator]


def test_a_p192_key_is_unsupported_key() -> None:
    csr = make_csr("jet-7", ec.generate_private_key(ec.SECP192R1()))
    assert refusal(csr, "jet-7").code == "unsupported_key"


def test_a_csr_whose_signature_does_not_match_its_key_is_bad_signature() -> None:
    der = x509.load_pem_x509_csr(make_csr("jet-a")).public_bytes(serialization.Encoding.DER)
    # The signed subject changed after signing: the CSR still parses, names jet-b, and its
    # signature (over "jet-a") no longer matches its key.
    tampered = der.replace(b"jet-a", b"jet-b")
    assert tampered != der
    tampered_pem = x509.load_der_x509_csr(tampered).public_bytes(serialization.Encoding.PEM)
    assert refusal(tampered_pem, "jet-b").code == "bad_signature"


def test_a_csr_signed_by_another_key_than_it_carries_is_bad_signature() -> None:
    ours, theirs = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    der_ours = x509.load_pem_x509_csr(make_csr("jet-7", ours)).public_bytes(serialization.Encoding.DER)
    spki_ours = ours.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    spki_theirs = theirs.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    swapped = der_ours.replace(spki_ours, spki_theirs)
    pem = x509.load_der_x509_csr(swapped).public_bytes(serialization.Encoding.PEM)
    assert refusal(pem, "jet-7").code == "bad_signature"


@pytest.mark.parametrize(
    "garbage",
    [b"", b"not a csr", b"-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n"],
)
def test_garbage_is_bad_csr(garbage: bytes) -> None:
    assert refusal(garbage, "jet-7").code == "bad_csr"


def test_a_csr_over_the_size_limit_is_refused_unread() -> None:
    huge = make_csr("jet-7") + b"\n" * MAX_CSR_BYTES
    refused = refusal(huge, "jet-7")
    assert refused.code == "bad_csr"
    assert str(MAX_CSR_BYTES) in refused.message
