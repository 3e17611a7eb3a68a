"""Telling the broker: each way it can go wrong says what to do in one line, and nothing is signalled
but a mosquitto (a real one is signalled in test_revocation.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from agent.fleet.ca.authority import DeviceAuthority
from agent.fleet.ca.broker import (
    BrokerSettings,
    devices_acl,
    tell_broker,
    write_broker_settings,
)
from agent.fleet.ca.ledger import IssuedLedger
from tests.fleet.ca.ca_rig import device_key_and_csr, make_ca


def test_without_a_recorded_broker_it_says_to_reload_by_hand(tmp_path: Path) -> None:
    ca = make_ca(tmp_path).ca
    told = tell_broker(ca)
    assert not told.told
    assert "systemctl reload mosquitto" in told.line
    assert str(ca.crl) in told.line


def test_a_pid_file_naming_another_program_is_not_signalled(tmp_path: Path) -> None:
    ca = make_ca(tmp_path).ca
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        pid_file = tmp_path / "mosquitto.pid"
        pid_file.write_text(f"{bystander.pid}\n")
        write_broker_settings(ca, BrokerSettings(pid_file=pid_file))
        told = tell_broker(ca)
        assert not told.told
        assert "not mosquitto" in told.line
        assert bystander.poll() is None  # SIGHUP would have ended it
    finally:
        bystander.kill()
        bystander.wait()


def test_a_stale_or_garbage_pid_file_is_reported(tmp_path: Path) -> None:
    ca = make_ca(tmp_path).ca
    pid_file = tmp_path / "mosquitto.pid"
    write_broker_settings(ca, BrokerSettings(pid_file=pid_file))
    for content in ("", "not a pid", str(2**22 + os.getpid())):
        pid_file.write_text(content)
        told = tell_broker(ca)
        assert not told.told
        assert "names no running process" in told.line
    pid_file.unlink()
    assert "names no running process" in tell_broker(ca).line


def test_only_devices_whose_every_current_certificate_is_revoked_are_denied(tmp_path: Path) -> None:
    done = make_ca(tmp_path)
    authority = DeviceAuthority.load(done.ca.path)
    for device in ("jet-1", "jet-2", "jet-3"):
        authority.issue(device_key_and_csr(device)[1])
    authority.revoke_device("jet-1", "stolen")
    authority.revoke_device("jet-2", "reset")
    authority.issue(device_key_and_csr("jet-2")[1])  # enrolled again
    ledger = IssuedLedger(done.ca.issued)
    assert ledger.denied_devices() == ["jet-1"]
    assert [ledger.is_denied(device) for device in ("jet-1", "jet-2", "jet-3", "jet-unknown")] == [
        True,
        False,
        False,
        False,
    ]
    assert done.ca.devices_acl.read_text() == devices_acl("fleet/v1", ["jet-1"])
    assert "user jet-1\ntopic deny #\n" in done.ca.devices_acl.read_text()
