"""``fleet keygen``: the operator's Ed25519 signing key pair, written as PEM files.

The private key signs deploy manifests and never leaves the operator's machine (file mode 0600);
the public key is copied to every device and listed under ``delivery.trusted_keys`` with its key id.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from agent.errors import ConfigError, UsageError
from agent.fsutil import atomic_write_bytes
from agent.signing import Ed25519PrivateKey, generate_keypair, key_fingerprint, load_private_key

#: A key id is written into manifests and into device configs: keep it a plain name.
_KEY_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class KeyPairFiles:
    """Where :func:`write_keypair` put the key pair, and the id to sign with."""

    key_id: str
    private: Path
    public: Path
    fingerprint: str


def check_key_id(key_id: str) -> str:
    """Return ``key_id`` if it is a usable key id, else raise ConfigError saying what is allowed."""
    if not _KEY_ID.match(key_id):
        raise ConfigError(
            f"key id {key_id!r} must be 1-64 characters of letters, digits, '_', '.' and '-', "
            "starting with a letter or digit"
        )
    return key_id


def write_keypair(out_dir: Path, key_id: str = "fleet", *, overwrite: bool = False) -> KeyPairFiles:
    """Generate a key pair into ``out_dir/{key_id}.key`` (mode 0600) and ``out_dir/{key_id}.pub``.

    Refuses to replace existing files unless ``overwrite``: losing a signing key means re-keying
    every device.
    """
    check_key_id(key_id)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    private_path, public_path = out_dir / f"{key_id}.key", out_dir / f"{key_id}.pub"
    for path in (private_path, public_path):
        if path.exists() and not overwrite:
            raise UsageError(
                f"{path} already exists; pass --force to replace it, or choose another --key-id or --out"
            )
    private_pem, public_pem = generate_keypair()
    # mkstemp creates the temporary file 0600, so the key is never readable by others, even briefly.
    atomic_write_bytes(private_path, private_pem, mode=0o600)
    atomic_write_bytes(public_path, public_pem, mode=0o644)
    fingerprint = key_fingerprint(load_private_key(private_path).public_key())
    return KeyPairFiles(key_id, private_path, public_path, fingerprint)


def load_signing_key(path: Path) -> Ed25519PrivateKey:
    """Read the private key ``fleet deploy --key`` signs with (ConfigError naming the file)."""
    return load_private_key(Path(path))
