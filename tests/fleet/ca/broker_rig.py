"""configs/mosquitto/ run as written: a real mosquitto, three listeners, a CA from ``fleet ca init``.

:class:`EnrollmentBroker` makes a CA with :func:`agent.fleet.ca.init_steps.init_ca` (the broker's
pid file recorded, so revocations SIGHUP this broker), copies the ACL files, makes an operator
password file with a password drawn at run time, and starts mosquitto with configs/mosquitto/
mosquitto.conf in which only the documented paths and the three port numbers are replaced.
"""

from __future__ import annotations

import secrets
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from agent.demo.broker import free_port
from agent.fleet.ca.authority import DeviceAuthority
from agent.fleet.ca.broker import BrokerSettings
from agent.fleet.ca.claims import ClaimBundle, make_claim
from agent.fleet.ca.init_steps import InitDone, init_ca
from agent.fleet.ca.pki import write_key
from tests.fleet.ca.ca_rig import device_key_and_csr
from tests.mqtt_probe import Probe
from tests.protocol.broker_doc import mosquitto_log, run_mosquitto
from tests.waiting import patient

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "mosquitto"
CONF = CONFIGS / "mosquitto.conf"
CA_DIR = "/var/lib/edge-fleet-controller/ca/"
#: What mosquitto's CONNACK or the TLS handshake said, as :func:`try_connect` reports it.
CONNECTED = "connected"
#: PUBACK reason code of a publish the ACL refused.
NOT_AUTHORIZED = 0x87
OPERATOR = "operator"


def accepted(puback: int) -> bool:
    """Whether a PUBACK reason code says the broker took the message (0, or 16: no subscriber)."""
    return puback < 0x80


class CountingProbe(Probe):
    """A probe that counts its connections and disconnections (paho reconnects on its own)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.connects = 0
        self.disconnects = 0
        super().__init__(*args, **kwargs)
        self.client.on_disconnect = self._on_disconnect

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason_code: Any, props: Any) -> None:
        if not reason_code.is_failure:
            self.connects += 1
        super()._on_connect(client, userdata, flags, reason_code, props)

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason_code: Any, props: Any) -> None:
        self.disconnects += 1


@dataclass
class EnrollmentBroker:
    """mosquitto running configs/mosquitto/mosquitto.conf; the doc's 8883, 8884, 8885 are the three ports."""

    workdir: Path
    ca: InitDone
    device_port: int
    operator_port: int
    enroll_port: int
    operator_password: str
    host: str = "127.0.0.1"
    _proc: subprocess.Popen[bytes] | None = None
    _probes: list[Probe] = field(default_factory=list)

    @classmethod
    def start(cls, workdir: Path, *, drop: tuple[str, ...] = ()) -> EnrollmentBroker:
        """Make the CA and start mosquitto; ``drop``: config lines to leave out, to show what a
        line protects against (never in a passing configuration test)."""
        etc, data = workdir / "etc", workdir / "data"
        etc.mkdir(parents=True)
        data.mkdir()
        pid_file = workdir / "mosquitto.pid"
        done = init_ca(
            workdir / "root",
            workdir / "ca",
            ("127.0.0.1", "localhost"),
            broker=BrokerSettings(pid_file=pid_file),
        )
        for name in ("enrollment.acl", "operators.acl"):
            (etc / name).write_text((CONFIGS / name).read_text())
        password = secrets.token_urlsafe(12)
        subprocess.run(
            ["mosquitto_passwd", "-c", "-b", str(etc / "operators.passwd"), OPERATOR, password],
            check=True,
            capture_output=True,
        )
        broker = cls(workdir, done, free_port(), free_port(), free_port(), password)
        lines = CONF.read_text().splitlines(keepends=True)
        text = "".join(line for line in lines if line.strip() not in drop)
        text = text.replace(CA_DIR, f"{done.ca.path}/").replace("/etc/mosquitto/", f"{etc}/")
        text = text.replace("/var/lib/mosquitto/", f"{data}/").replace(
            "/run/mosquitto/mosquitto.pid", str(pid_file)
        )
        for documented, port in (
            (8883, broker.device_port),
            (8884, broker.operator_port),
            (8885, broker.enroll_port),
        ):
            text = text.replace(f"listener {documented}\n", f"listener {port} {broker.host}\n")
        ports = (broker.device_port, broker.operator_port, broker.enroll_port)
        broker._proc = run_mosquitto(workdir, text, broker.host, ports)
        return broker

    def log(self) -> str:
        """Everything mosquitto logged."""
        return mosquitto_log(self.workdir)

    def handshakes_refused(self) -> int:
        """How many client certificates mosquitto refused so far (its log's OpenSSL verify errors)."""
        return self.log().count("certificate verify failed")

    def authority(self) -> DeviceAuthority:
        return DeviceAuthority.load(self.ca.ca.path)

    def enroll(self, device_id: str) -> dict[str, str]:
        """Issue ``device_id`` a certificate as the desk would; its TLS files as ``tls_set`` arguments."""
        key, checked = device_key_and_csr(device_id)
        issued = self.authority().issue(checked)
        name = f"{device_id}-{issued.serial}"  # a device enrolled again keeps its old files apart
        key_file, cert_file = self.workdir / f"{name}.key", self.workdir / f"{name}.crt"
        write_key(key_file, key)
        cert_file.write_bytes(issued.cert_pem + issued.chain_pem)
        return {"ca_certs": str(self.ca.ca.root_cert), "certfile": str(cert_file), "keyfile": str(key_file)}

    def claim(self, name: str) -> dict[str, str]:
        """A claim bundle (``fleet ca claim``) as ``tls_set`` arguments."""
        bundle: ClaimBundle = make_claim(
            self.ca.ca.path, name, uses=5, days=1, out_dir=self.workdir / f"claim-{name}"
        )
        return {
            "ca_certs": str(bundle.ca_file),
            "certfile": str(bundle.cert_file),
            "keyfile": str(bundle.key_file),
        }

    def operator_tls(self) -> dict[str, str]:
        return {"ca_certs": str(self.ca.ca.root_cert)}

    def probe(self, port: int, client_id: str, **kwargs: Any) -> CountingProbe:
        """A connected probe on ``port`` (closed at :meth:`stop`)."""
        probe = CountingProbe(self.host, port, client_id=client_id, **kwargs)
        self._probes.append(probe)
        return probe

    def operator(self) -> CountingProbe:
        return self.probe(
            self.operator_port,
            f"fleet:op-{secrets.token_hex(3)}",
            username=OPERATOR,
            password=self.operator_password,
            tls=self.operator_tls(),
        )

    def stop(self) -> None:
        for probe in self._probes:
            probe.close()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=patient(5))


def try_connect(host: str, port: int, client_id: str, tls: dict[str, str], **login: str) -> str:
    """One connection attempt: :data:`CONNECTED`, or what refused it (CONNACK reason, TLS error)."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    client.tls_set(**tls)  # type: ignore[arg-type]
    if login:
        client.username_pw_set(login["username"], login["password"])
    answered = threading.Event()
    outcome: list[str] = []

    def on_connect(_c: Any, _u: Any, _f: Any, reason_code: Any, _p: Any) -> None:
        outcome.append(CONNECTED if not reason_code.is_failure else str(reason_code))
        answered.set()

    def on_disconnect(_c: Any, _u: Any, _f: Any, reason_code: Any, _p: Any) -> None:
        # Closed before any CONNACK: with TLS 1.3 a refused client certificate shows only here.
        outcome.append(f"tls refused: closed before CONNACK ({reason_code})")
        answered.set()

    client.on_connect = on_connect
    client.on_disconnect = on_disconnect
    try:
        client.connect(host, port)
    except OSError as exc:  # ssl.SSLError included: the handshake happens inside connect()
        return f"tls refused: {exc}"
    client.loop_start()
    try:
        if not answered.wait(patient(10)):
            return "no answer"
        return outcome[0]
    finally:
        client.disconnect()
        client.loop_stop()
