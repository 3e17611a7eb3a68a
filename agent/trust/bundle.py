"""An offline bundle's signed index: the desired states, root chain and bytes a bundle file carries.

A bundle is an uncompressed POSIX tar read and written as a stream (docs/bundles.md). Its first
member is the index, signed by the controller key; every other member is named in it with its
SHA-256 and size, in the order the index lists them: the root chain, each device's desired states
(the exact ``down/desired/{target}`` payloads the controller published), then the bytes they name,
each once by SHA-256. The signature protects the file as a whole against damage and swaps; every
desired state inside is still checked by the device's own trust rules (its fleet root, or its
trusted keys), exactly as over MQTT.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Literal

from pydantic import Field, ValidationError, field_validator
from tuf.api.metadata import Metadata, Root

from agent.errors import AgentError
from agent.model_base import StrictModel
from agent.names import NAME_PATTERN, NAME_RULE
from agent.protocol.delivery_errors import RejectedError
from agent.protocol.device_targets import DEVICE_TARGETS
from agent.protocol.engines import SignedEngine
from agent.protocol.manifest import SignedManifest
from agent.protocol.manifest_signature import check_signature, signature_for
from agent.protocol.messages import MAX_ROOT_CHAIN_BYTES
from agent.signing import Ed25519PrivateKey, Ed25519PublicKey
from agent.trust.deployment import check_controller

FORMAT = 1
INDEX_MEMBER = "index.json"
ROOT_MEMBER = "trust/root.json"
#: Bytes the signed index may take (thousands of devices' entries fit).
MAX_INDEX_BYTES = 4 * 1024 * 1024
#: Bytes one desired state may take (a manifest with its chunk hashes and its release).
MAX_DESIRED_BYTES = 2 * 1024 * 1024
#: Members a bundle may hold beside its index: the reader stops at the first one more.
MAX_MEMBERS = 4096
#: Shared engines carried for one device (one per slot and build plan is the usual count).
MAX_ENGINES_PER_DEVICE = 64
#: Bytes one carried file may take (the largest model, engine or wheel a device would fetch).
MAX_BLOB_BYTES = 64 * 1024**3

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class BundleError(AgentError):
    """The bundle is refused; the message names the member and what was wrong with it."""


class CarriedFile(StrictModel):
    """One member's content: its SHA-256 and size."""

    sha256: str = Field(pattern=_SHA256.pattern, description="SHA-256 of the member's bytes (lowercase hex).")
    size: int = Field(ge=0, le=MAX_BLOB_BYTES, description="The member's size in bytes.")


class DesiredEntry(CarriedFile):
    """One desired state of a device: the payload of its ``down/desired/{target}`` topic."""

    target: str = Field(description="A model slot, or a device target (_config, _agent).")
    size: int = Field(gt=0, le=MAX_DESIRED_BYTES, description="The payload's size in bytes.")

    @field_validator("target")
    @classmethod
    def _target(cls, target: str) -> str:
        if target not in DEVICE_TARGETS and not NAME_PATTERN.match(target):
            raise ValueError(
                f"target {target!r} is not a slot name ({NAME_RULE}) nor one of {sorted(DEVICE_TARGETS)}"
            )
        return target


class BundleIndex(StrictModel):
    """What a bundle carries, in member order."""

    format: Literal[1] = Field(description="The bundle format's version.")
    created_at: datetime = Field(description="When the bundle was made (UTC).")
    devices: dict[str, list[DesiredEntry]] = Field(description="Per device id, its desired states.")
    root_chain: CarriedFile | None = Field(
        None, description="The retained {prefix}/_trust/root chain, when the fleet has a root."
    )
    blobs: list[CarriedFile] = Field(
        description="The bytes the desired states and the shared engines name, each once."
    )
    engines: dict[str, list[SignedEngine]] = Field(
        default_factory=dict,
        description="Per device id, the shared engines the controller holds for its platform, each as "
        "the controller signed it (its files are blobs).",
    )

    @field_validator("devices")
    @classmethod
    def _devices(cls, devices: dict[str, list[DesiredEntry]]) -> dict[str, list[DesiredEntry]]:
        for device, entries in devices.items():
            if not NAME_PATTERN.match(device):
                raise ValueError(f"device id {device!r}: {NAME_RULE}")
            targets = [entry.target for entry in entries]
            if len(set(targets)) != len(targets):
                raise ValueError(f"device {device!r} has two desired states for one target")
        return devices

    @field_validator("engines")
    @classmethod
    def _engines(cls, engines: dict[str, list[SignedEngine]]) -> dict[str, list[SignedEngine]]:
        for device, signed in engines.items():
            if len(signed) > MAX_ENGINES_PER_DEVICE:
                raise ValueError(f"device {device!r} has more than {MAX_ENGINES_PER_DEVICE} engines")
        return engines

    @field_validator("blobs")
    @classmethod
    def _blobs(cls, blobs: list[CarriedFile]) -> list[CarriedFile]:
        if len({blob.sha256 for blob in blobs}) != len(blobs):
            raise ValueError("a file is listed twice (each is carried once by SHA-256)")
        return blobs

    def members(self) -> list[tuple[str, CarriedFile]]:
        """Every member after the index, in the order the file holds them."""
        members: list[tuple[str, CarriedFile]] = []
        if self.root_chain is not None:
            members.append((ROOT_MEMBER, self.root_chain))
        for device, entries in self.devices.items():
            members.extend((desired_member(device, entry.target), entry) for entry in entries)
        members.extend((blob_member(blob.sha256), blob) for blob in self.blobs)
        if len(members) > MAX_MEMBERS:
            raise BundleError(f"the index lists {len(members)} members, more than {MAX_MEMBERS}")
        return members


class SignedIndex(StrictModel):
    """The index member: the index's JSON text, exactly as signed, and the signature over it."""

    index: str = Field(description="The BundleIndex JSON, exactly the bytes that were signed.")
    key_id: str = Field(description="Id of the controller key that signed it.")
    signature: str = Field(description="Base64 Ed25519 signature of the index's UTF-8 bytes.")


def desired_member(device: str, target: str) -> str:
    """The member holding ``device``'s desired state of ``target``."""
    return f"desired/{device}/{target}"


def blob_member(sha256: str) -> str:
    """The member holding the file with this SHA-256."""
    return f"blobs/{sha256}"


def signed_index(index: BundleIndex, key: Ed25519PrivateKey, key_id: str) -> bytes:
    """The index member's bytes: ``index`` signed with the controller key."""
    text = index.model_dump_json()
    return (
        SignedIndex(index=text, key_id=key_id, signature=signature_for(text, key)).model_dump_json().encode()
    )


def read_index(data: bytes) -> tuple[SignedIndex, BundleIndex]:
    """The signed index and the index inside it (not yet checked against any key)."""
    if len(data) > MAX_INDEX_BYTES:
        raise BundleError(f"{INDEX_MEMBER}: larger than {MAX_INDEX_BYTES} bytes")
    try:
        signed = SignedIndex.model_validate_json(data)
        index = BundleIndex.model_validate_json(signed.index)
    except ValidationError as exc:
        problem = exc.errors()[0]
        where = ".".join(str(p) for p in problem["loc"])
        raise BundleError(f"{INDEX_MEMBER}: not a bundle index ({where}: {problem['msg']})") from exc
    index.members()  # bounded before anything is read
    return signed, index


def check_index_signature(
    signed: SignedIndex,
    *,
    root: Metadata[Root] | None,
    trusted: dict[str, Ed25519PublicKey],
) -> None:
    """Raise :class:`BundleError` unless a controller key signed the index: one of ``root``'s controller
    keys when the device has a fleet root, else one of its ``delivery.trusted_keys``."""
    try:
        if root is not None:
            check_controller(root, SignedManifest(manifest=signed.index, key_id=signed.key_id,
                                                  signature=signed.signature), None)  # fmt: skip
        else:
            check_signature(
                signed.index,
                signed.key_id,
                signed.signature,
                trusted=trusted,
                require_signature=True,
                job_id=None,
            )
    except RejectedError as exc:
        raise BundleError(f"{INDEX_MEMBER}: the bundle's signature is refused ({exc.code}): {exc}") from exc


def root_chain_bound() -> int:
    """Bytes the root chain member may take: what the device takes over MQTT."""
    return MAX_ROOT_CHAIN_BYTES


def index_text(index: BundleIndex) -> str:
    """The index as operators read it (``fleet bundle --json``)."""
    return json.dumps(index.model_dump(mode="json"), indent=2)
