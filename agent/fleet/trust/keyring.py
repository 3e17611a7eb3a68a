"""The fleet's trust keys as files on the operator's machine: Ed25519 PEM pairs, read as TUF keys.

The same key files as ``fleet keygen`` writes (:mod:`agent.fleet.deploy.keys`); TUF names a key by the
SHA-256 of its canonical public form, which is the id root metadata and signatures carry.
"""

from __future__ import annotations

from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from securesystemslib.signer import CryptoSigner, SSlibKey

from agent.errors import ConfigError
from agent.fleet.deploy.keys import KeyPairFiles, load_signing_key, write_keypair
from agent.signing import load_public_key


def make_key(out_dir: Path, name: str) -> KeyPairFiles:
    """A new key pair ``out_dir/{name}.key`` (0600) and ``.pub``; refuses to replace one."""
    return write_keypair(out_dir, name)


def public_key(path: Path) -> SSlibKey:
    """The TUF key of a ``.pub`` file (or of a private key file's public half)."""
    if path.suffix == ".key":
        return signer(path).public_key
    return SSlibKey.from_crypto(load_public_key(path))


def signer(path: Path) -> CryptoSigner:
    """A signer of the private key file ``path`` (ConfigError naming the file)."""
    private: Ed25519PrivateKey = load_signing_key(path)
    key = SSlibKey.from_crypto(private.public_key())
    return CryptoSigner(private, key)


def key_id_of(path: Path) -> str:
    """The TUF key id of a key file (private or public)."""
    try:
        return public_key(path).keyid
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
