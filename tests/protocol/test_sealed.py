"""Sealed values: open only on the device they were sealed to, under the key they were sealed for."""

from __future__ import annotations

import base64

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from agent.protocol.sealed import SEALED_PREFIX, SealedValueError, open_sealed, seal

KEY = "streams.cam.source.password"


@pytest.fixture
def device_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def test_a_sealed_value_opens_on_its_device_under_its_key(device_key: ec.EllipticCurvePrivateKey) -> None:
    clear = b"s3" + bytes(range(8))  # made at run time, not a real secret
    sealed = seal(clear, device_key.public_key(), "dev-1", KEY)
    assert sealed.startswith(SEALED_PREFIX)
    assert clear.hex() not in sealed
    assert open_sealed(sealed, device_key, "dev-1", KEY) == clear
    # Two seals of one value differ (a fresh ephemeral key and nonce each time).
    assert seal(clear, device_key.public_key(), "dev-1", KEY) != sealed


def test_another_devices_key_cannot_open_it(device_key: ec.EllipticCurvePrivateKey) -> None:
    sealed = seal(b"value", device_key.public_key(), "dev-1", KEY)
    other = ec.generate_private_key(ec.SECP256R1())
    with pytest.raises(SealedValueError, match="does not open with this device's key"):
        open_sealed(sealed, other, "dev-1", KEY)
    with pytest.raises(SealedValueError):
        open_sealed(sealed, device_key, "dev-2", KEY)  # the same key under another device id


def test_a_value_moved_to_another_key_is_refused(device_key: ec.EllipticCurvePrivateKey) -> None:
    sealed = seal(b"value", device_key.public_key(), "dev-1", KEY)
    with pytest.raises(SealedValueError, match=r"streams\.other\.source\.password"):
        open_sealed(sealed, device_key, "dev-1", "streams.other.source.password")


def test_tampered_or_malformed_values_are_refused(device_key: ec.EllipticCurvePrivateKey) -> None:
    sealed = seal(b"value", device_key.public_key(), "dev-1", KEY)
    raw = bytearray(base64.urlsafe_b64decode(sealed[len(SEALED_PREFIX) :] + "=="))
    raw[-1] ^= 1
    flipped = SEALED_PREFIX + base64.urlsafe_b64encode(bytes(raw)).decode().rstrip("=")
    with pytest.raises(SealedValueError, match="altered"):
        open_sealed(flipped, device_key, "dev-1", KEY)
    for bad in (SEALED_PREFIX + "AAAA", SEALED_PREFIX + "!!!", "clear text"):
        with pytest.raises(SealedValueError):
            open_sealed(bad, device_key, "dev-1", KEY)
