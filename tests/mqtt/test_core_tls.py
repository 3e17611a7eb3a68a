"""TLS with client certificates (CN = device id = MQTT user name) and the per-device ACL pattern.

The PKI is made by openssl in the test: an EC P-256 CA, a server certificate for 127.0.0.1 and
client certificates for a device and an operator.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from agent.demo.broker import Broker
from agent.mqtt.settings import TlsSettings
from tests.mqtt.conftest import LinkFactory, fast_settings
from tests.mqtt_probe import Probe
from tests.waiting import wait_until


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _issue(pki: Path, name: str, cn: str, ext: str) -> None:
    (pki / f"{name}.ext").write_text(ext)
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", f"{name}.key", cwd=pki)
    _openssl("req", "-new", "-key", f"{name}.key", "-subj", f"/CN={cn}", "-out", f"{name}.csr", cwd=pki)
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-days", "2", "-sha256", "-extfile", f"{name}.ext", "-out", f"{name}.crt", cwd=pki,
    )  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pki = tmp_path_factory.mktemp("pki")
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "ca.key", cwd=pki)
    _openssl(
        "req",
        "-x509",
        "-new",
        "-key",
        "ca.key",
        "-subj",
        "/CN=test-ca",
        "-days",
        "2",
        "-out",
        "ca.crt",
        cwd=pki,
    )
    _issue(
        pki, "server", "127.0.0.1", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"
    )
    _issue(pki, "dev-tls", "dev-tls", "extendedKeyUsage=clientAuth\n")
    _issue(pki, "operator", "operator", "extendedKeyUsage=clientAuth\n")
    return pki


def test_tls_client_cert_and_device_acl(
    pki: Path, broker_factory: Callable[[Sequence[str]], Broker], make_link: LinkFactory, tmp_path: Path
) -> None:
    acl = tmp_path / "acl"
    acl.write_text(
        "pattern write fleet/v1/%u/up/#\npattern read fleet/v1/%u/down/#\n"
        "user operator\ntopic readwrite fleet/v1/#\n"
    )
    b = broker_factory(
        [
            f"cafile {pki / 'ca.crt'}",
            f"certfile {pki / 'server.crt'}",
            f"keyfile {pki / 'server.key'}",
            "require_certificate true",
            "use_identity_as_username true",
            f"acl_file {acl}",
        ]
    )
    tls = TlsSettings(ca_file=pki / "ca.crt", cert_file=pki / "dev-tls.crt", key_file=pki / "dev-tls.key")
    seen: list[bytes] = []
    link = make_link(fast_settings(b, tls=tls), client_id="dev-tls")
    link.subscribe("fleet/v1/dev-tls/down/cmd/+", lambda m: seen.append(m.payload))
    link.start()
    wait_until(lambda: link.connected, what="TLS connect")
    probe_tls = {
        "ca_certs": str(pki / "ca.crt"),
        "certfile": str(pki / "operator.crt"),
        "keyfile": str(pki / "operator.key"),
    }
    with Probe(b.host, b.port, tls=probe_tls) as probe:
        probe.subscribe("fleet/v1/#")
        link.publish("fleet/v1/dev-tls/up/jobs/j1", b"mine", durable=True)
        # Another device's topic: the ACL pattern scopes this certificate to its own subtree.
        link.publish("fleet/v1/dev-other/up/jobs/j1", b"not-mine", durable=True)
        probe.wait_for_count("fleet/v1/dev-tls/up/jobs/j1", 1)
        probe.publish("fleet/v1/dev-tls/down/cmd/status", b"cmd")
        wait_until(lambda: seen == [b"cmd"], what="command over TLS")
        wait_until(lambda: link.stats()["spool_depth"] == 0, what="spool drained")
        assert probe.on_topic("fleet/v1/dev-other/up/jobs/j1") == []
    assert link.stats()["acl_denied"] == 1


def test_tls_refuses_a_broker_signed_by_another_ca(
    pki: Path, broker_factory: Callable[[Sequence[str]], Broker], make_link: LinkFactory, tmp_path: Path
) -> None:
    other = tmp_path / "other-ca"
    other.mkdir()
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "ca.key", cwd=other)
    _openssl(
        "req",
        "-x509",
        "-new",
        "-key",
        "ca.key",
        "-subj",
        "/CN=other",
        "-days",
        "2",
        "-out",
        "ca.crt",
        cwd=other,
    )
    b = broker_factory(
        [f"cafile {pki / 'ca.crt'}", f"certfile {pki / 'server.crt'}", f"keyfile {pki / 'server.key'}"]
    )
    link = make_link(fast_settings(b, tls=TlsSettings(ca_file=other / "ca.crt")), client_id="dev-tls-bad")
    link.start()
    wait_until(lambda: link.stats()["connect_failures"] >= 2, what="refused TLS handshakes")
    assert not link.connected
