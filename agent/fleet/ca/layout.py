"""Where the fleet's CA keeps each file: the offline root's directory and the controller's CA directory.

The root directory holds the root key and is meant to leave the controller host after
``fleet ca init`` (it is needed again only to renew the devices intermediate). The CA directory
is what the controller holds: the intermediate it issues device certificates with, the claims CA,
the broker's certificate, the CRL and the two ledgers. docs/enrollment.md lists them for operators.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from agent.errors import ConfigError
from agent.fleet.ca.pki import DIR_MODE

#: The controller's CA directory unless ``--ca-dir`` names another: inside its default state_dir.
DEFAULT_CA_DIR = Path("/var/lib/edge-fleet-controller/ca")


@dataclass(frozen=True)
class RootDir:
    """The offline root: its key and certificate."""

    path: Path

    @property
    def key(self) -> Path:
        return self.path / "root.key"

    @property
    def cert(self) -> Path:
        return self.path / "root.crt"


@dataclass(frozen=True)
class CaDir:
    """The controller's CA directory."""

    path: Path

    @property
    def broker_dir(self) -> Path:
        """What the broker reads (mode 0755 in a CA directory of 0711: mosquitto, which reads the CRL
        and the ACL again as its own user on SIGHUP, reaches it by name and cannot list or read a key)."""
        return self.path / "broker"

    @property
    def root_cert(self) -> Path:
        """The device root: the trust anchor devices and operators verify the broker with (``ca_file``)."""
        return self.path / "root.crt"

    @property
    def devices_key(self) -> Path:
        return self.path / "devices-ca.key"

    @property
    def devices_cert(self) -> Path:
        return self.path / "devices-ca.crt"

    @property
    def devices_trust(self) -> Path:
        """The intermediate then the root: the ``cafile`` of the broker's devices listener."""
        return self.broker_dir / "devices-trust.pem"

    @property
    def crl(self) -> Path:
        """The devices intermediate's CRL: the ``crlfile`` of the broker's devices listener."""
        return self.broker_dir / "devices.crl"

    @property
    def issued(self) -> Path:
        """The ledger of every device certificate issued and not long expired."""
        return self.path / "issued.sqlite"

    @property
    def claims_key(self) -> Path:
        return self.path / "claims-ca.key"

    @property
    def claims_cert(self) -> Path:
        """The claims CA: the ``cafile`` of the broker's enrollment listener."""
        return self.broker_dir / "claims-ca.crt"

    @property
    def claims(self) -> Path:
        """The ledger of claims made: name, serial, uses, expiry."""
        return self.path / "claims.json"

    @property
    def devices_acl(self) -> Path:
        """The devices listener's ACL file, written from the ledger (revoked devices denied)."""
        return self.broker_dir / "devices.acl"

    @property
    def broker_settings(self) -> Path:
        """``broker.json``: the topic prefix and the local broker's pid file, from ``fleet ca init``."""
        return self.path / "broker.json"

    @property
    def server_cert(self) -> Path:
        """The broker's server certificate (both listeners)."""
        return self.broker_dir / "server.crt"

    @property
    def server_key(self) -> Path:
        return self.broker_dir / "server.key"

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the CA directory's lock: the controller and a CLI command never interleave a ledger write."""
        fd = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


ModelT = TypeVar("ModelT", bound=BaseModel)


def read_json_model(path: Path, model: type[ModelT], what: str) -> ModelT:
    """The JSON file ``path`` as ``model`` (its defaults when there is no file yet; ConfigError
    naming ``what`` and the file when it is damaged)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return model()
    try:
        return model.model_validate(json.loads(text))
    except (ValueError, ValidationError) as exc:
        raise ConfigError(f"{what} {path} is damaged: {exc}") from exc


def make_private_dir(path: Path, mode: int = DIR_MODE) -> None:
    """Create ``path`` (and parents) with ``mode`` (0700), and set that mode if it exists."""
    path.mkdir(parents=True, exist_ok=True, mode=mode)
    path.chmod(mode)
