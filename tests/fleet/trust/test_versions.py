"""The offline trust steps: keys made 0600, root versions rotated, revoked and signed, each taken by a
device's own rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.errors import UsageError
from agent.fleet.trust import versions
from agent.fleet.trust.keyring import key_id_of, make_key
from agent.fleet.trust.versions import TrustDir
from agent.trust.roles import RELEASE, revoked_keys
from agent.trust.root import RootRefusedError, newest_root, next_root, read_root


def test_init_makes_private_keys_only_the_owner_reads_and_a_root_signed_by_all(tmp_path: Path) -> None:
    root = versions.init(tmp_path, root_keys=3, threshold=2, expires_days=365)
    keys = sorted(p.name for p in (tmp_path / "keys").glob("*.key"))
    assert keys == ["controller.key", "release.key", "root-1.key", "root-2.key", "root-3.key"]
    for key in (tmp_path / "keys").glob("*.key"):
        assert key.stat().st_mode & 0o777 == 0o600
    assert len(root.signatures) == 3
    assert root.signed.roles["root"].threshold == 2
    with pytest.raises(UsageError, match="already holds a root"):
        versions.init(tmp_path, root_keys=3, threshold=2, expires_days=365)


def test_a_rotated_release_key_takes_effect_once_a_threshold_of_root_keys_signed(tmp_path: Path) -> None:
    v1 = versions.init(tmp_path, root_keys=3, threshold=2, expires_days=365)
    keys = tmp_path / "keys"
    new = make_key(keys, "release-2")
    old_id = key_id_of(keys / "release.pub")
    versions.rotate(
        tmp_path, role="release", add=[new.public], remove=[old_id], threshold=None, expires_days=365
    )
    versions.sign(tmp_path, keys / "root-1.key")
    one = TrustDir(tmp_path).newest()
    with pytest.raises(RootRefusedError):
        next_root(v1, one)  # one root key of a threshold of two
    versions.sign(tmp_path, keys / "root-2.key")
    v2 = next_root(v1, TrustDir(tmp_path).newest())
    assert v2.signed.roles[RELEASE].keyids == [key_id_of(new.public)]


def test_revoke_takes_the_key_out_of_every_role_and_lists_it(tmp_path: Path) -> None:
    v1 = versions.init(tmp_path, root_keys=2, threshold=1, expires_days=365)
    keys = tmp_path / "keys"
    versions.rotate(
        tmp_path,
        role="controller",
        add=[make_key(keys, "controller-2").public],
        remove=[],
        threshold=None,
        expires_days=365,
    )
    versions.sign(tmp_path, keys / "root-1.key")
    stolen = key_id_of(keys / "controller.pub")
    versions.revoke(tmp_path, stolen, expires_days=365)
    versions.sign(tmp_path, keys / "root-2.key")
    chain = [read_root(json.dumps(item).encode()) for item in TrustDir(tmp_path).chain().roots]
    root, refused = newest_root(v1, chain)
    assert (root.signed.version, refused) == (3, [])
    assert stolen in revoked_keys(root)
    assert all(stolen not in role.keyids for role in root.signed.roles.values())


def test_revoking_the_last_key_of_a_role_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    versions.init(tmp_path, root_keys=2, threshold=1, expires_days=365)
    with pytest.raises(UsageError, match="would keep 0 key"):
        versions.revoke(tmp_path, key_id_of(tmp_path / "keys" / "release.pub"), expires_days=365)
    assert TrustDir(tmp_path).versions() == [1]


def test_a_key_that_is_no_root_key_signs_nothing(tmp_path: Path) -> None:
    versions.init(tmp_path, root_keys=2, threshold=1, expires_days=365)
    with pytest.raises(UsageError, match="not a root key"):
        versions.sign(tmp_path, tmp_path / "keys" / "controller.key")
