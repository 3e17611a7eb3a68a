"""The broker's ACL scopes each device to its own topics: a manifest for another device is never seen.

A real mosquitto with password auth and the ACL pattern from docs/protocol.md (``%u`` = device id).
"""

from __future__ import annotations

import secrets
import subprocess
from pathlib import Path

from tests.mqtt_probe import Probe

#: Each account's password for this run (made at run time: a password is never a constant).
PASSWORDS = {user: secrets.token_urlsafe(16) for user in ("dev-a", "dev-b", "operator")}


def _broker_with_acl(tmp_path: Path, broker_factory: object) -> object:
    passwd = tmp_path / "passwd"
    for i, (user, password) in enumerate(PASSWORDS.items()):
        flags = ["-c"] if i == 0 else []
        subprocess.run(["mosquitto_passwd", *flags, "-b", str(passwd), user, password], check=True)
    acl = tmp_path / "acl"
    acl.write_text(
        "user operator\n"
        "topic readwrite fleet/v1/#\n"
        "\n"
        "pattern write fleet/v1/%u/up/#\n"
        "pattern read fleet/v1/%u/down/#\n"
    )
    return broker_factory(  # type: ignore[operator]
        ["allow_anonymous false", f"password_file {passwd}", f"acl_file {acl}"]
    )


def test_a_device_never_sees_another_devices_manifest(tmp_path: Path, broker_factory: object) -> None:
    broker = _broker_with_acl(tmp_path, broker_factory)
    host, port = broker.host, broker.port  # type: ignore[attr-defined]
    with (
        Probe(host, port, client_id="dev-a", username="dev-a", password=PASSWORDS["dev-a"]) as dev_a,
        Probe(host, port, client_id="dev-b", username="dev-b", password=PASSWORDS["dev-b"]) as dev_b,
        Probe(
            host, port, client_id="operator", username="operator", password=PASSWORDS["operator"]
        ) as operator,
    ):
        dev_a.subscribe("fleet/v1/dev-b/down/#")  # not allowed: the broker grants it but delivers nothing
        dev_a.subscribe("fleet/v1/dev-a/down/#")
        dev_b.subscribe("fleet/v1/dev-b/down/#")
        operator.publish("fleet/v1/dev-b/down/desired/cls", b'{"manifest": "for b"}', qos=1, retain=True)
        operator.publish("fleet/v1/dev-a/down/desired/cls", b'{"manifest": "for a"}', qos=1, retain=True)
        dev_b.wait_for_count("fleet/v1/dev-b/down/desired/cls", 1, timeout=5)
        dev_a.wait_for_count("fleet/v1/dev-a/down/desired/cls", 1, timeout=5)
        dev_a.settle(0.5)
        assert [m.topic for m in dev_a.snapshot()] == ["fleet/v1/dev-a/down/desired/cls"]
        # A device cannot write into another device's tree either (QoS 1: PUBACK 0x87 not authorized).
        assert dev_a.publish("fleet/v1/dev-b/up/status", b"{}", qos=1) == 0x87
        # Its own tree is fine (0x10 "no matching subscribers" is a success code).
        assert dev_a.publish("fleet/v1/dev-a/up/status", b"{}", qos=1) in (0x00, 0x10)
