"""The broker configuration of docs/protocol.md, run as written: a real mosquitto with TLS and the ACL.

:func:`doc_config` takes the fenced ``conf`` and ``acl`` blocks out of the doc's "Broker configuration"
section; :class:`DocBroker` writes them, with only the documented paths and ports replaced, next to a
PKI made here with ``cryptography`` (a device CA, a server certificate for 127.0.0.1, one client
certificate per device with CN = device id) and an operator password file, then starts mosquitto.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import secrets
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from agent.demo.broker import free_port, mosquitto_binary, port_open
from agent.mqtt.settings import MqttSettings, TlsSettings
from tests.waiting import patient

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
OPERATOR = "operator"
#: Passwords of this run (made at run time: a password is never a constant).
OPERATOR_PASSWORD = secrets.token_urlsafe(16)
#: The reader account of the doc's ACL (Telegraf in docs/operations.md).
READER = "telegraf"
READER_PASSWORD = secrets.token_urlsafe(16)
_START_TIMEOUT_S = 10.0
_LOOPBACK = ipaddress.ip_address("127.0.0.1")


def doc_config() -> tuple[str, str]:
    """The mosquitto config and ACL file of docs/protocol.md's "Broker configuration", verbatim."""
    text = DOC.read_text()
    section = re.search(r"^## Broker configuration\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert section, "docs/protocol.md has no '## Broker configuration' section"
    conf = re.search(r"^```conf\n(.*?)^```", section.group(1), re.S | re.M)
    acl = re.search(r"^```acl\n(.*?)^```", section.group(1), re.S | re.M)
    assert conf, "the broker configuration section needs a ```conf block (mosquitto.conf)"
    assert acl, "the broker configuration section needs an ```acl block (the ACL file)"
    return conf.group(1), acl.group(1)


def doc_client_id_prefix() -> str:
    """The ``clientid_prefixes`` of the doc's configuration: every client id must start with it."""
    found = re.search(r"^clientid_prefixes (\S+)$", doc_config()[0], re.M)
    assert found, "the broker configuration has no clientid_prefixes line"
    return found.group(1)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )


class Pki:
    """A device CA and the certificates issued by it, as PEM files in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._ca_key = ec.generate_private_key(ec.SECP256R1())
        self.ca_cert = self._sign(_name("edge-agent test device CA"), self._ca_key.public_key(), ca=True)
        self.ca_file = directory / "devices-ca.crt"
        self.ca_file.write_bytes(self.ca_cert.public_bytes(serialization.Encoding.PEM))
        self.issue("server", "127.0.0.1", server=True)

    def _sign(
        self,
        subject: x509.Name,
        public_key: ec.EllipticCurvePublicKey,
        *,
        ca: bool = False,
        server: bool = False,
    ) -> x509.Certificate:
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(_name("edge-agent test device CA"))
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(_LOOPBACK)]),
                critical=False,
            ).add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        elif not ca:
            builder = builder.add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
            )
        return builder.sign(self._ca_key, hashes.SHA256())

    def issue(self, name: str, cn: str, *, server: bool = False) -> tuple[Path, Path]:
        """Write ``name.crt`` (CN ``cn``) and ``name.key``; return their paths."""
        key = ec.generate_private_key(ec.SECP256R1())
        cert = self._sign(_name(cn), key.public_key(), server=server)
        crt_path, key_path = self.dir / f"{name}.crt", self.dir / f"{name}.key"
        crt_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, key_path)
        return crt_path, key_path

    def device_tls(self, device: str) -> TlsSettings:
        """TLS settings of a device holding the certificate issued to ``device`` (issued on first use)."""
        crt, key = self.dir / f"{device}.crt", self.dir / f"{device}.key"
        if not crt.exists():
            self.issue(device, device)
        return TlsSettings(ca_file=self.ca_file, cert_file=crt, key_file=key)

    def probe_tls(self, device: str) -> dict[str, str]:
        """The same, as ``paho.Client.tls_set`` keyword arguments (for tests/mqtt_probe.Probe)."""
        tls = self.device_tls(device)
        return {"ca_certs": str(tls.ca_file), "certfile": str(tls.cert_file), "keyfile": str(tls.key_file)}


def run_mosquitto(workdir: Path, config: str, host: str, ports: tuple[int, ...]) -> subprocess.Popen[bytes]:
    """Write ``config`` to ``workdir/mosquitto.conf`` (logging everything to ``workdir``), start
    mosquitto with it and wait until each of ``ports`` accepts connections."""
    if os.geteuid() == 0:
        # As root mosquitto drops to user `mosquitto`, which cannot read the test's private files.
        config = "user root\n" + config
    config += f"log_dest file {workdir / 'mosquitto.log'}\nlog_type all\n"
    (workdir / "mosquitto.conf").write_text(config)
    with (workdir / "stderr.log").open("ab") as err:
        proc = subprocess.Popen(
            [mosquitto_binary(), "-c", str(workdir / "mosquitto.conf")], stdout=err, stderr=subprocess.STDOUT
        )
    deadline = time.monotonic() + patient(_START_TIMEOUT_S)
    while time.monotonic() < deadline and proc.poll() is None:
        if all(port_open(host, port) for port in ports):
            return proc
        time.sleep(0.05)
    proc.kill()
    proc.wait(timeout=patient(5))
    conf = workdir / "mosquitto.conf"
    raise RuntimeError(f"mosquitto did not start with {conf}:\n{mosquitto_log(workdir)}")


def mosquitto_log(workdir: Path) -> str:
    """Everything a mosquitto run by :func:`run_mosquitto` logged (stderr, and its ``log_dest file``)."""
    return "".join(
        path.read_text(errors="replace")
        for path in (workdir / "stderr.log", workdir / "mosquitto.log")
        if path.exists()
    )


@dataclass
class DocBroker:
    """mosquitto running docs/protocol.md's configuration.

    ``device_port`` stands for the doc's 8883, ``operator_port`` for its 8884.
    """

    workdir: Path
    pki: Pki
    device_port: int
    operator_port: int
    host: str = "127.0.0.1"
    _proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def start(cls, workdir: Path, *, drop: tuple[str, ...] = ()) -> DocBroker:
        """Write the doc's files under ``workdir`` and start mosquitto with them.

        ``drop``: config lines to leave out, to show what a line protects against (never in a
        passing configuration test).
        """
        etc = workdir / "etc"
        pki = Pki(etc / "certs")
        (workdir / "data").mkdir(parents=True, exist_ok=True)
        conf, acl = doc_config()
        (etc / "edge-agent.acl").write_text(acl)
        for account, password, create in (
            (OPERATOR, OPERATOR_PASSWORD, ["-c"]),
            (READER, READER_PASSWORD, []),
        ):
            subprocess.run(
                ["mosquitto_passwd", *create, "-b", str(etc / "operators.passwd"), account, password],
                check=True,
                capture_output=True,
            )
        broker = cls(workdir, pki, free_port(), free_port())
        lines = [line for line in conf.splitlines() if line.strip() not in drop]
        text = "\n".join(lines) + "\n"
        text = text.replace("/etc/mosquitto/conf.d/", f"{etc}/").replace("/etc/mosquitto/", f"{etc}/")
        text = text.replace("/var/lib/mosquitto/", f"{workdir / 'data'}/")
        text = text.replace("listener 8883\n", f"listener {broker.device_port} {broker.host}\n")
        text = text.replace("listener 8884\n", f"listener {broker.operator_port} {broker.host}\n")
        broker._proc = run_mosquitto(workdir, text, broker.host, (broker.device_port, broker.operator_port))
        return broker

    def log(self) -> str:
        """Everything mosquitto logged (``log_type all``)."""
        return mosquitto_log(self.workdir)

    def device_settings(self, device: str, prefix: str = "fleet/v1", **overrides: object) -> MqttSettings:
        """MqttSettings of the agent on ``device``: the device listener with its certificate."""
        values: dict[str, object] = {
            "host": self.host,
            "port": self.device_port,
            "prefix": prefix,
            "client_id_prefix": doc_client_id_prefix(),
            "tls": self.pki.device_tls(device),
            "reconnect_min_s": 0.05,
            "reconnect_max_s": 0.3,
            "keepalive_s": 5,
            "max_payload_bytes": 2 * 1024 * 1024,
        }
        values.update(overrides)
        return MqttSettings.model_validate(values)

    def operator_settings(self, password_file: Path, prefix: str = "fleet/v1") -> MqttSettings:
        """MqttSettings of an operator tool: the operator listener, user name and password."""
        password_file.write_text(OPERATOR_PASSWORD)
        return MqttSettings(
            host=self.host,
            port=self.operator_port,
            prefix=prefix,
            client_id_prefix=doc_client_id_prefix(),
            tls=TlsSettings(ca_file=self.pki.ca_file),
            username=OPERATOR,
            password_file=password_file,
            reconnect_min_s=0.05,
            reconnect_max_s=0.3,
            keepalive_s=5,
            max_payload_bytes=2 * 1024 * 1024,
        )

    def client_id(self, name: str) -> str:
        """``name`` with the prefix the doc's configuration wants of every client id."""
        return doc_client_id_prefix() + name

    def stop(self) -> None:
        """Kill mosquitto (tests need no orderly shutdown)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=patient(5))
