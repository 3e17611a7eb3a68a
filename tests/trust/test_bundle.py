"""An offline bundle's index: names that could leave the bundle are refused before anything is read,
the member count is bounded, and the signature is checked by the device's own keys."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import pytest
from pydantic import ValidationError

from agent.fleet.deploy.keys import load_signing_key, write_keypair
from agent.signing import load_public_key
from agent.trust.bundle import (
    MAX_MEMBERS,
    BundleError,
    BundleIndex,
    CarriedFile,
    DesiredEntry,
    check_index_signature,
    read_index,
    signed_index,
)

SHA = "ab" * 32


def index(devices: dict[str, list[DesiredEntry]], blobs: int = 0) -> BundleIndex:
    files = [CarriedFile(sha256=f"{n:064x}", size=1) for n in range(blobs)]
    return BundleIndex(format=1, created_at=datetime.now(timezone.utc), devices=devices, blobs=files)


@pytest.mark.parametrize("device", ["../etc", "a/b", "", ".hidden"])
def test_a_device_id_that_is_not_one_name_is_refused(device: str) -> None:
    with pytest.raises(ValidationError, match="device id"):
        index({device: []})


@pytest.mark.parametrize("target", ["../x", "a/b", "_other"])
def test_a_target_that_is_not_a_slot_or_a_device_target_is_refused(target: str) -> None:
    with pytest.raises(ValidationError, match="is not a slot name"):
        DesiredEntry(target=target, sha256=SHA, size=10)


def test_a_file_listed_twice_is_refused() -> None:
    with pytest.raises(ValidationError, match="listed twice"):
        BundleIndex(format=1, created_at=datetime.now(timezone.utc), devices={},
                    blobs=[CarriedFile(sha256=SHA, size=1)] * 2)  # fmt: skip


def test_more_members_than_the_bound_are_refused_before_any_is_read(tmp_path: Path) -> None:
    keys = write_keypair(tmp_path)
    data = signed_index(index({}, blobs=MAX_MEMBERS + 1), load_signing_key(keys.private), keys.key_id)
    with pytest.raises(BundleError, match=f"more than {MAX_MEMBERS}"):
        read_index(data)


def test_a_trusted_key_checks_the_index_on_a_device_without_a_root(tmp_path: Path) -> None:
    keys = write_keypair(tmp_path / "k")
    other = write_keypair(tmp_path / "o", key_id="other")
    data = signed_index(index({"cam-a": []}), load_signing_key(keys.private), keys.key_id)
    signed, _ = read_index(data)
    check_index_signature(signed, root=None, trusted={keys.key_id: load_public_key(keys.public)})
    with pytest.raises(BundleError, match="unknown_key"):
        check_index_signature(signed, root=None, trusted={"other": load_public_key(other.public)})
