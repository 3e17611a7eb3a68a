"""The broker's side of revocation: the devices listener's ACL file and telling mosquitto to reload.

Mosquitto 2.0 re-reads ``crlfile`` and ``acl_file`` on SIGHUP, but a CRL only refuses the next
TLS handshake: a revoked device that is connected stays connected. So the devices listener's ACL
is written here, from the ledger: the documented patterns, preceded by ``user ID`` /
``topic deny #`` for each device whose every current certificate is revoked; on SIGHUP that
device loses every topic at once, while the other devices keep their connections. The deny
lines go when the device's certificates have expired (the broker refuses them then anyway) or
when it is issued a new certificate.

Which broker to tell is recorded in ``broker.json`` in the CA directory by ``fleet ca init``: the
pid file of a mosquitto on this host, or none (the broker runs elsewhere: copy the CRL and the
ACL there and run ``systemctl reload mosquitto``; docs/enrollment.md).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

import structlog
from pydantic import BaseModel, ConfigDict

from agent.fleet.ca.layout import CaDir, read_json_model
from agent.fsutil import atomic_write_json, atomic_write_text

log = structlog.get_logger(__name__)

#: A pid file longer than this is not mosquitto's.
_MAX_PID_FILE_BYTES = 64


class BrokerSettings(BaseModel):
    """``broker.json``: the topic prefix the devices ACL scopes, and the local broker's pid file."""

    model_config = ConfigDict(extra="forbid")

    prefix: str = "fleet/v1"
    pid_file: Path | None = None


@dataclass(frozen=True)
class BrokerTold:
    """Whether the broker was told to reload, and one line saying what happened or what to do."""

    told: bool
    line: str


def read_broker_settings(ca: CaDir) -> BrokerSettings:
    """``broker.json`` (defaults when there is none; ConfigError naming a damaged file)."""
    return read_json_model(ca.broker_settings, BrokerSettings, "the broker settings")


def write_broker_settings(ca: CaDir, settings: BrokerSettings) -> None:
    """Write ``broker.json`` (temp + fsync + rename)."""
    atomic_write_json(ca.broker_settings, settings.model_dump(mode="json"), mode=0o600)


def devices_acl(prefix: str, denied: list[str]) -> str:
    """The devices listener's ACL file: a deny block per device in ``denied``, then the patterns."""
    lines = ["# Written by edge-agent fleet ca: revoked devices first, then every device's own tree."]
    for device_id in denied:
        lines += [f"user {device_id}", "topic deny #", ""]
    lines += [
        "# Devices: the user name is the certificate CN, which is the device id.",
        f"pattern write {prefix}/%u/up/#",
        f"pattern read {prefix}/%u/down/#",
    ]
    return "\n".join(lines) + "\n"


def write_devices_acl(ca: CaDir, denied: list[str]) -> bool:
    """Rewrite the devices ACL (temp + fsync + rename, 0644) denying ``denied``; whether it changed."""
    text = devices_acl(read_broker_settings(ca).prefix, denied)
    try:
        if ca.devices_acl.read_text() == text:
            return False
    except FileNotFoundError:
        pass
    atomic_write_text(ca.devices_acl, text, mode=0o644)
    return True


def tell_broker(ca: CaDir) -> BrokerTold:
    """SIGHUP the local mosquitto named by ``broker.json``'s pid file, so it re-reads the CRL and ACL."""
    pid_file = read_broker_settings(ca).pid_file
    by_hand = (
        f"copy {ca.crl} and {ca.devices_acl} to the broker's host and run `systemctl reload mosquitto` there"
    )
    if pid_file is None:
        return _outcome(False, f"no local broker recorded in {ca.broker_settings}: {by_hand}")
    try:
        pid = int(pid_file.read_bytes()[:_MAX_PID_FILE_BYTES].strip())
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except (OSError, ValueError) as exc:
        return _outcome(
            False, f"the broker's pid file {pid_file} names no running process ({exc}): {by_hand}"
        )
    if name != "mosquitto":
        return _outcome(False, f"pid {pid} from {pid_file} is {name!r}, not mosquitto: {by_hand}")
    try:
        os.kill(pid, signal.SIGHUP)
    except PermissionError:
        return _outcome(
            False, f"not allowed to signal mosquitto (pid {pid}): run `systemctl reload mosquitto` as root"
        )
    except ProcessLookupError:
        return _outcome(
            False, f"mosquitto (pid {pid}) has exited: start it; it reads {ca.crl} when it starts"
        )
    return _outcome(True, f"mosquitto (pid {pid}) told to reload the CRL and the devices ACL (SIGHUP)")


def _outcome(told: bool, line: str) -> BrokerTold:
    if told:
        log.info("fleet.ca.broker_reloaded", detail=line)
    else:
        log.warning("fleet.ca.broker_not_told", detail=line)
    return BrokerTold(told, line)
