"""``fleet keygen``'s key files: private 0600, readable by the agent's signing code, never overwritten."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from agent.errors import ConfigError
from agent.fleet.deploy.keys import write_keypair
from agent.signing import key_fingerprint, load_private_key, load_public_key, sign, verify


def test_key_pair_signs_and_verifies_and_the_private_key_is_0600(tmp_path: Path) -> None:
    pair = write_keypair(tmp_path / "keys", "ops-1")

    assert pair.private == tmp_path / "keys" / "ops-1.key"
    assert stat.S_IMODE(pair.private.stat().st_mode) == 0o600
    private, public = load_private_key(pair.private), load_public_key(pair.public)
    assert verify(public, b"manifest", sign(private, b"manifest"))
    assert not verify(public, b"manifest!", sign(private, b"manifest"))
    assert pair.fingerprint == key_fingerprint(public)


def test_existing_keys_are_not_replaced_unless_forced(tmp_path: Path) -> None:
    first = write_keypair(tmp_path, "ops")
    before = first.private.read_bytes()
    with pytest.raises(ConfigError, match="already exists"):
        write_keypair(tmp_path, "ops")
    assert first.private.read_bytes() == before
    second = write_keypair(tmp_path, "ops", overwrite=True)
    assert second.private.read_bytes() != before


@pytest.mark.parametrize("key_id", ["", "../etc", "a/b", "-x", "x" * 65])
def test_unusable_key_ids_are_refused(tmp_path: Path, key_id: str) -> None:
    with pytest.raises(ConfigError, match="key id"):
        write_keypair(tmp_path, key_id)
    assert list(tmp_path.iterdir()) == []
