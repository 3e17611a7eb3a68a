"""``edge-agent fleet ca init|intermediate|claim`` as an operator types them."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography import x509

from agent.cli import main
from agent.fleet.ca.claims import read_claims
from agent.fleet.ca.layout import CaDir
from agent.fleet.ca.pki import read_cert


def fleet_ca(*argv: str | Path) -> int:
    return main(["fleet", "ca", *map(str, argv)])


def test_init_then_a_claim_then_the_intermediate_renewed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, ca = tmp_path / "root", tmp_path / "ca"
    hosts = ("--broker-host", "mqtt.example.com", "--broker-host", "10.0.0.5")
    assert fleet_ca("init", "--root-dir", root, "--ca-dir", ca, *hosts) == 0
    out = capsys.readouterr().out
    layout = CaDir(ca)
    assert f"crlfile {layout.crl}" in out
    assert "move it off the controller host" in out
    names = read_cert(layout.server_cert).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert [str(n.value) for n in names.value] == ["mqtt.example.com", "10.0.0.5"]

    bundle = tmp_path / "bundle"
    assert fleet_ca("claim", "line-3", "--uses", "7", "--days", "3", "--ca-dir", ca, "--out", bundle) == 0
    assert "7 uses" in capsys.readouterr().out
    assert (bundle / "claim.key").stat().st_mode & 0o777 == 0o600
    assert read_claims(ca)["line-3"].uses == 7

    before = read_cert(layout.devices_cert)
    assert fleet_ca("intermediate", "--root-dir", root, "--ca-dir", ca, "--days", "30") == 0
    after = read_cert(layout.devices_cert)
    assert after.serial_number != before.serial_number
    assert after.public_key() == before.public_key()
    assert "no local broker recorded" in capsys.readouterr().out


def test_init_twice_and_a_claim_name_reused_are_refused_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    init = ("init", "--root-dir", tmp_path / "r", "--ca-dir", tmp_path / "c", "--broker-host", "b")
    assert fleet_ca(*init) == 0
    capsys.readouterr()
    assert fleet_ca(*init) != 0
    assert "exists already" in capsys.readouterr().err
    claim = ("claim", "b1", "--ca-dir", tmp_path / "c", "--out", tmp_path / "b1")
    assert fleet_ca(*claim) == 0
    assert fleet_ca(*claim) != 0
    assert "exists already" in capsys.readouterr().err


def test_revoking_a_device_without_certificates_exits_1_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ca = tmp_path / "c"
    assert fleet_ca("init", "--root-dir", tmp_path / "r", "--ca-dir", ca, "--broker-host", "b") == 0
    capsys.readouterr()
    assert main(["fleet", "devices", "revoke", "jet-none", "--ca-dir", str(ca)]) == 1
    out = capsys.readouterr().out
    assert "revoked none (no current certificate)" in out
    assert "no local broker recorded" in out
    assert main(["fleet", "devices", "revoke", "jet/bad", "--ca-dir", str(ca)]) != 0
