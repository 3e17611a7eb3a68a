"""The fleet root's rules: a threshold of root keys, rotation signed by old and new, replays refused."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from agent.trust.root import RootRefusedError, check_self_signed, newest_root, next_root, read_root
from tests.trust.fleet_keys import FleetKeys, in_days, signer


def test_a_root_signed_by_fewer_root_keys_than_its_threshold_is_refused() -> None:
    keys = FleetKeys()
    check_self_signed(keys.root(sign_with=2))
    with pytest.raises(RootRefusedError) as refused:
        check_self_signed(keys.root(sign_with=1))
    assert refused.value.code == "unsigned_by_new"


def test_a_rotated_root_signed_by_a_threshold_of_the_old_and_the_new_keys_is_taken() -> None:
    keys = FleetKeys()
    v1 = keys.root(1)
    keys.root_keys[2] = signer()  # one root key replaced: two of the old keys stay
    v2 = keys.root(2)
    assert next_root(v1, v2) is v2


def test_a_root_signed_only_by_new_keys_is_refused_by_the_old_threshold() -> None:
    keys = FleetKeys()
    v1 = keys.root(1)
    keys.root_keys = [signer() for _ in range(3)]  # a thief's own root keys
    with pytest.raises(RootRefusedError) as refused:
        next_root(v1, keys.root(2))
    assert refused.value.code == "unsigned_by_old"


def test_a_root_the_old_keys_signed_but_its_own_new_keys_did_not_is_refused() -> None:
    keys = FleetKeys()
    v1 = keys.root(1)
    old = list(keys.root_keys)
    keys.root_keys = [signer() for _ in range(3)]
    v2 = keys.root(2, sign_with=0)
    for key in old[:2]:
        v2.sign(key, append=True)
    with pytest.raises(RootRefusedError) as refused:
        next_root(v1, v2)
    assert refused.value.code == "unsigned_by_new"


def test_an_old_root_replayed_is_refused_and_the_current_one_stays() -> None:
    keys = FleetKeys()
    v1, v2 = keys.root(1), keys.root(2)
    with pytest.raises(RootRefusedError) as refused:
        next_root(v2, v1)
    assert refused.value.code == "replayed"
    root, why = newest_root(v2, [v1])
    assert root is v2
    assert [e.code for e in why] == ["replayed"]


def test_a_chain_is_walked_version_by_version_and_a_gap_stops_it() -> None:
    keys = FleetKeys()
    v1, v2, v3, v5 = keys.root(1), keys.root(2), keys.root(3), keys.root(5)
    root, why = newest_root(v1, [v3, v2, v1])
    assert (root.signed.version, why) == (3, [])
    root, why = newest_root(v1, [v1, v2, v5])
    assert root.signed.version == 2
    assert [e.code for e in why] == ["gap"]


def test_an_expired_root_reads_as_expired_and_a_fresh_one_does_not() -> None:
    keys = FleetKeys()
    now = datetime.now(timezone.utc)
    assert keys.root(expires=in_days(-1)).signed.is_expired(now)
    assert not keys.root(expires=in_days(1)).signed.is_expired(now)


def test_bytes_that_are_not_root_metadata_are_refused_by_name() -> None:
    with pytest.raises(RootRefusedError, match="not TUF root metadata") as refused:
        read_root(b'{"signed": {}}', "root.json")
    assert refused.value.code == "bad_root"
