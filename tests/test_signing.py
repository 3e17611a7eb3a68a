"""Ed25519 keys (PEM and raw base64) and detached signatures over exact bytes."""

from __future__ import annotations

import base64
import subprocess
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from agent.errors import ConfigError
from agent.signing import (
    Ed25519PublicKey,
    generate_keypair,
    key_fingerprint,
    load_private_key,
    load_public_key,
    sign,
    verify,
)


def test_pem_round_trip(tmp_path: Path) -> None:
    private_pem, public_pem = generate_keypair()
    assert private_pem.startswith(b"-----BEGIN PRIVATE KEY-----")
    assert public_pem.startswith(b"-----BEGIN PUBLIC KEY-----")
    (tmp_path / "k.pem").write_bytes(private_pem)
    (tmp_path / "k.pub").write_bytes(public_pem)
    private, public = load_private_key(tmp_path / "k.pem"), load_public_key(tmp_path / "k.pub")
    data = b'{"job_id":"j","sequence":1}'
    signature = sign(private, data)
    assert len(signature) == 64
    assert verify(public, data, signature)
    assert not verify(public, data + b" ", signature)
    assert not verify(public, data, bytes(64))
    other_public = load_public_key_from_pem(generate_keypair()[1], tmp_path)
    assert not verify(other_public, data, signature)


def load_public_key_from_pem(pem: bytes, tmp_path: Path) -> Ed25519PublicKey:
    path = tmp_path / "other.pub"
    path.write_bytes(pem)
    return load_public_key(path)


def test_raw_base64_keys(tmp_path: Path) -> None:
    private_pem, public_pem = generate_keypair()
    private = serialization.load_pem_private_key(private_pem, password=None)
    raw_private = private.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    raw_public = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    (tmp_path / "raw.key").write_bytes(base64.b64encode(raw_private) + b"\n")
    (tmp_path / "raw.pub").write_bytes(base64.b64encode(raw_public) + b"\n")
    signature = sign(load_private_key(tmp_path / "raw.key"), b"abc")
    (tmp_path / "pem.pub").write_bytes(public_pem)
    assert verify(load_public_key(tmp_path / "pem.pub"), b"abc", signature)
    assert key_fingerprint(load_public_key(tmp_path / "raw.pub")) == key_fingerprint(
        load_public_key(tmp_path / "pem.pub")
    )


def test_unusable_key_files_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read key file .*missing\.pub"):
        load_public_key(tmp_path / "missing.pub")
    (tmp_path / "garbage.pub").write_text("hello")
    with pytest.raises(ConfigError, match="neither PEM nor a base64 raw 32-byte"):
        load_public_key(tmp_path / "garbage.pub")
    ec_pem = (
        ec.generate_private_key(ec.SECP256R1())
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    (tmp_path / "ec.pub").write_bytes(ec_pem)
    with pytest.raises(ConfigError, match="not Ed25519"):
        load_public_key(tmp_path / "ec.pub")
    (tmp_path / "short.key").write_bytes(base64.b64encode(b"x" * 16))
    with pytest.raises(ConfigError, match=r"short\.key"):
        load_private_key(tmp_path / "short.key")


def test_a_trusted_key_in_the_documented_forms_loads(tmp_path: Path) -> None:
    """docs/protocol.md: ``delivery.trusted_keys`` takes SubjectPublicKeyInfo PEM (``BEGIN PUBLIC KEY``)
    as openssl writes it, or the raw 32-byte key in base64."""
    private = tmp_path / "k.pem"
    subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(private)], check=True)
    public_pem = subprocess.run(
        ["openssl", "pkey", "-in", str(private), "-pubout"], check=True, capture_output=True
    ).stdout
    assert public_pem.startswith(b"-----BEGIN PUBLIC KEY-----\n")
    (tmp_path / "k.pub").write_bytes(public_pem)
    signature = sign(load_private_key(private), b"manifest")
    assert verify(load_public_key(tmp_path / "k.pub"), b"manifest", signature)


def test_a_private_or_openssh_key_as_trusted_key_is_one_clear_error(tmp_path: Path) -> None:
    private_pem, _ = generate_keypair()
    (tmp_path / "oops.pub").write_bytes(private_pem)
    with pytest.raises(ConfigError, match=r"oops\.pub: holds a PRIVATE key; give an Ed25519 public key"):
        load_public_key(tmp_path / "oops.pub")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "id")], check=True)
    with pytest.raises(ConfigError, match=r"id\.pub: is an OpenSSH public key; give .*BEGIN PUBLIC KEY"):
        load_public_key(tmp_path / "id.pub")
