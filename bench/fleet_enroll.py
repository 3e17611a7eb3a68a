"""Scenario 9 of bench/fleet.py: N simulated devices from claim to online with their own certificates.

The broker is configs/mosquitto/mosquitto.conf as written (three TLS listeners, only its paths and
ports replaced), the CA made by ``fleet ca init``'s steps, one claim for all the devices (``fleet
ca claim``), every device id in the controller's ``enrollment.registered_file`` (admitted at
once). Each simulated device, as the agent does: a P-256 key made here, a CSR for its id, the
request signed by the claim key, sent on the enrollment listener as client ``fleet:enroll:ID``;
then the certificate it got opens the devices listener, where it publishes its retained online
status and stays connected. The devices share processes of 125 devices each and ``--workers``
threads in all; the controller is its own process, as in production, over the operator listener.

Measured: seconds from the first request to the controller's /metrics counting every device
enrolled and online, each device's claim-to-online seconds (median, 95th percentile, max), the
controller's CPU seconds (in all, and from the first request on) and peak RSS, and the load
average at the start and the end.
"""

from __future__ import annotations

import multiprocessing
import os
import secrets
import statistics
import subprocess
import threading
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from paho.mqtt.enums import CallbackAPIVersion

from agent.demo.broker import free_port, mosquitto_binary, port_open
from agent.fleet.ca.broker import BrokerSettings
from agent.fleet.ca.claims import make_claim
from agent.fleet.ca.init_steps import InitDone, init_ca
from agent.protocol.enrollment import EnrollReply, EnrollRequest, enroll_client_id, signed_request_bytes
from agent.protocol.messages import StatusMessage, decode, encode
from agent.protocol.topics import Topics, enroll_reply, enroll_request

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs" / "mosquitto"
#: The documented broker's prefix (its ACL files name it).
PREFIX = "fleet/v1"
#: The documented paths in mosquitto.conf, replaced by this run's.
_CA_DIR = "/var/lib/edge-fleet-controller/ca/"
OPERATOR = "operator"
#: Simulated devices per process (three file descriptors each while connected).
DEVICES_PER_PROCESS = 125


@dataclass
class DocumentedBroker:
    """mosquitto on configs/mosquitto/mosquitto.conf: devices, operator and enrollment ports."""

    work: Path
    ca: InitDone
    ports: dict[int, int]  # documented port -> this run's
    password_file: Path
    proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def start(cls, work: Path) -> DocumentedBroker:
        etc = work / "etc"
        etc.mkdir(parents=True)
        pid_file = work / "mosquitto.pid"
        done = init_ca(
            work / "root",
            work / "ca",
            ("127.0.0.1",),
            broker=BrokerSettings(prefix=PREFIX, pid_file=pid_file),
        )
        for name in ("enrollment.acl", "operators.acl"):
            (etc / name).write_text((CONFIGS / name).read_text())
        password = secrets.token_urlsafe(16)
        subprocess.run(
            ["mosquitto_passwd", "-c", "-b", str(etc / "operators.passwd"), OPERATOR, password],
            check=True,
            capture_output=True,
        )
        password_file = work / "operator.password"
        password_file.write_text(password)
        password_file.chmod(0o600)
        broker = cls(work, done, {p: free_port() for p in (8883, 8884, 8885)}, password_file)
        text = (CONFIGS / "mosquitto.conf").read_text().replace(_CA_DIR, f"{done.ca.path}/")
        text = text.replace("/etc/mosquitto/", f"{etc}/").replace("/var/lib/mosquitto/", f"{work}/")
        text = text.replace("/run/mosquitto/mosquitto.pid", str(pid_file))
        for documented, port in broker.ports.items():
            text = text.replace(f"listener {documented}\n", f"listener {port} 127.0.0.1\n")
        if os.geteuid() == 0:
            text = "user root\n" + text  # as root mosquitto drops to `mosquitto`, who cannot read these files
        text += "max_queued_messages 100000\n"
        (work / "mosquitto.conf").write_text(text)
        with (work / "mosquitto.log").open("ab") as log:
            broker.proc = subprocess.Popen(
                [mosquitto_binary(), "-c", str(work / "mosquitto.conf")], stdout=log, stderr=log
            )
        deadline = time.monotonic() + 30
        while not all(port_open("127.0.0.1", p) for p in broker.ports.values()):
            if time.monotonic() > deadline or broker.proc.poll() is not None:
                raise RuntimeError(f"mosquitto did not start: {(work / 'mosquitto.log').read_text()}")
            time.sleep(0.05)
        return broker

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


def controller_config(broker: DocumentedBroker, registered: Path, http_port: int) -> str:
    """The controller's YAML: the operator listener, unsigned (no rollout here), enrollment on."""
    ca = broker.ca.ca
    return (
        f"mqtt: {{host: 127.0.0.1, port: {broker.ports[8884]}, prefix: {PREFIX}, client_id_prefix: 'fleet:', "
        f"username: {OPERATOR}, password_file: {broker.password_file}, tls: {{ca_file: {ca.root_cert}}}}}\n"
        f"state_dir: {broker.work / 'controller'}\nunsigned: true\nhttp: {{port: {http_port}}}\n"
        f"enrollment: {{ca_dir: {ca.path}, registered_file: {registered}}}\n"
    )


@dataclass
class Enrolled:
    device_id: str
    seconds: float  # from its first request to its online status acknowledged
    client: mqtt.Client  # its connection on the devices listener, kept open


def _connect(client: mqtt.Client, port: int, timeout: float) -> None:
    connected = threading.Event()
    refused: list[str] = []

    def on_connect(_c: Any, _u: Any, _f: Any, reason: Any, _p: Any) -> None:
        if reason.is_failure:
            refused.append(str(reason))
        connected.set()

    client.on_connect = on_connect
    client.connect("127.0.0.1", port, keepalive=3600)
    client.loop_start()
    if not connected.wait(timeout) or refused:
        raise RuntimeError(f"connection to port {port} failed: {refused or 'no CONNACK'}")


@dataclass(frozen=True)
class Endpoints:
    """What a simulated device needs: the claim's files, the trust anchor, the two listeners' ports."""

    claim_cert: Path
    claim_key: Path
    root_cert: Path
    device_port: int
    enroll_port: int
    files: Path  # where each device's key and certificate go


class SimulatedDevice:
    """One device enrolling with the claim as the agent does (see the module docstring)."""

    def __init__(self, device_id: str, at: Endpoints) -> None:
        self.device_id = device_id
        self.at = at

    def request(self, key: ec.EllipticCurvePrivateKey) -> EnrollRequest:
        csr = (
            x509.CertificateSigningRequestBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, self.device_id)]))
            .sign(key, hashes.SHA256())
        )
        fields: dict[str, Any] = {
            "device_id": self.device_id,
            "request_id": uuid.uuid4().hex[:16],
            "csr_pem": csr.public_bytes(serialization.Encoding.PEM).decode(),
            "claim_cert_pem": self.at.claim_cert.read_text(),
            "msg_id": uuid.uuid4().hex,
            "ts": time.time(),
        }
        claim_key = serialization.load_pem_private_key(self.at.claim_key.read_bytes(), password=None)
        assert isinstance(claim_key, ec.EllipticCurvePrivateKey)
        signature = claim_key.sign(signed_request_bytes(fields), ec.ECDSA(hashes.SHA256()))
        return EnrollRequest(**fields, claim_signature=signature.hex())

    def enroll(self, timeout: float) -> Enrolled:
        started = time.monotonic()
        key = ec.generate_private_key(ec.SECP256R1())
        reply = self._ask(self.request(key), timeout)
        if reply.outcome != "issued" or reply.cert_pem is None:
            raise RuntimeError(f"{self.device_id}: {reply.outcome} {reply.code}: {reply.message}")
        key_file, cert_file = self.at.files / f"{self.device_id}.key", self.at.files / f"{self.device_id}.crt"
        key_file.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        key_file.chmod(0o600)
        cert_file.write_text(reply.cert_pem + (reply.chain_pem or ""))
        device = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=f"fleet:{self.device_id}", protocol=mqtt.MQTTv5
        )
        device.tls_set(ca_certs=str(self.at.root_cert), certfile=str(cert_file), keyfile=str(key_file))
        _connect(device, self.at.device_port, timeout)
        status = StatusMessage(state="online", session=1, agent_version="bench")
        device.publish(
            Topics(PREFIX, self.device_id).status, encode(status), qos=1, retain=True
        ).wait_for_publish(timeout)
        return Enrolled(self.device_id, time.monotonic() - started, device)

    def _ask(self, request: EnrollRequest, timeout: float) -> EnrollReply:
        client_id = enroll_client_id(self.device_id, "fleet:")
        replies: list[EnrollReply] = []
        answered = threading.Event()

        def on_message(_c: Any, _u: Any, message: mqtt.MQTTMessage) -> None:
            reply = decode(EnrollReply, bytes(message.payload))
            if reply.request_id == request.request_id:
                replies.append(reply)
                answered.set()

        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        client.tls_set(
            ca_certs=str(self.at.root_cert), certfile=str(self.at.claim_cert), keyfile=str(self.at.claim_key)
        )
        client.on_message = on_message
        try:
            _connect(client, self.at.enroll_port, timeout)
            client.subscribe(enroll_reply(PREFIX, client_id), qos=1)
            time.sleep(0.05)  # the SUBACK before the request: the reply is not retained
            client.publish(enroll_request(PREFIX, client_id), encode(request), qos=1)
            if not answered.wait(timeout):
                raise RuntimeError(f"{self.device_id}: no reply within {timeout:.0f}s")
            return replies[0]
        finally:
            client.disconnect()
            client.loop_stop()


def _enroll_slice(ids: list[str], at: Endpoints, workers: int, results: Any, stop: Any) -> None:
    """One simulator process: enroll ``ids`` on ``workers`` threads, report (id, seconds) or the
    error, and keep the devices connected until ``stop`` is set."""
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            done = list(pool.map(lambda d: SimulatedDevice(d, at).enroll(300.0), ids))
    except Exception as exc:  # the parent reports it; a half-enrolled slice measures nothing
        results.put(repr(exc))
        return
    results.put([(d.device_id, d.seconds) for d in done])
    stop.wait(3600)
    for device in done:
        device.client.disconnect()
        device.client.loop_stop()


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def run_enrollment(root: Path, devices: int, workers: int, controller_factory: Any) -> dict[str, Any]:
    """Scenario 9 (see the module docstring); ``controller_factory(config, log)`` starts the
    controller as bench/fleet.py's other scenarios do (its ``sample`` and ``stop`` measure it)."""
    work = root / "scenario-9"
    work.mkdir(parents=True)
    broker = DocumentedBroker.start(work)
    claim = make_claim(broker.ca.ca.path, "bench", uses=devices, days=1, out_dir=work / "claim")
    ids = [f"sim-{n:05d}" for n in range(devices)]
    registered = work / "registered.yaml"
    registered.write_text("devices:\n" + "".join(f"  - {{id: {d}}}\n" for d in ids))
    http_port = free_port()
    config = work / "controller.yaml"
    config.write_text(controller_config(broker, registered, http_port))
    log = work / "controller.log"
    controller = controller_factory(config, log)
    url = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + 120
    while b"requests on" not in (log.read_bytes() if log.exists() else b""):
        if time.monotonic() > deadline or controller.proc.poll() is not None:
            raise RuntimeError(f"the controller did not start: {log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.2)
    files = work / "devices"
    files.mkdir()
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(1.0):
            controller.sample()

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    controller.sample()
    cpu_before = float(getattr(controller, "_cpu_now", 0.0))  # its start-up, left out of the figure below
    at = Endpoints(
        claim.cert_file, claim.key_file, broker.ca.ca.root_cert, broker.ports[8883], broker.ports[8885], files
    )
    # Processes of at most DEVICES_PER_PROCESS devices: paho's loop uses select(), which fails past
    # file descriptor 1024, and each connected device holds three.
    context = multiprocessing.get_context("fork")
    results, stop = context.Queue(), context.Event()
    slices = [ids[n : n + DEVICES_PER_PROCESS] for n in range(0, len(ids), DEVICES_PER_PROCESS)]
    per_process = max(1, workers // len(slices))
    load_start = os.getloadavg()
    t0 = time.monotonic()
    processes = [
        context.Process(target=_enroll_slice, args=(part, at, per_process, results, stop)) for part in slices
    ]
    for process in processes:
        process.start()
    done: list[tuple[str, float]] = []
    for _ in processes:
        part = results.get(timeout=1800)
        if isinstance(part, str):
            stop.set()
            raise RuntimeError(f"a simulator process failed: {part}")  # noqa: TRY004 (its report)
        done += part
    enrolled_at = time.monotonic() - t0
    while _metric(url, "edge_device_online{") < devices or _metric(url, "edge_enroll_enrolled") < devices:
        if time.monotonic() - t0 > 1800:
            raise RuntimeError("the controller did not see every device online within 30 minutes")
        time.sleep(0.5)
    total = time.monotonic() - t0
    load_end = os.getloadavg()
    sampling.set()
    sampler.join()
    controller.sample()
    cpu_enrolling = float(getattr(controller, "_cpu_now", 0.0)) - cpu_before
    issued = _metric(url, 'edge_enroll_replies_total{outcome="issued"}')
    refused = _metric(url, 'edge_enroll_replies_total{outcome="refused"}')
    measured = controller.stop()
    stop.set()
    for process in processes:
        process.join(60)
    broker.stop()
    seconds = sorted(s for _, s in done)
    return {
        "scenario": 9,
        "devices": devices,
        "workers": workers,
        "simulator_processes": len(processes),
        "seconds_to_all_online": round(total, 1),
        "seconds_devices_enrolled": round(enrolled_at, 1),
        "per_device_s": {
            "p50": round(statistics.median(seconds), 2),
            "p95": round(seconds[int(0.95 * (len(seconds) - 1))], 2),
            "max": round(seconds[-1], 2),
        },
        "issued": int(issued),
        "refused": int(refused),
        "controller": {
            "cpu_s": measured["cpu_s"],
            "cpu_s_enrolling": round(cpu_enrolling, 2),
            "peak_rss_mb": measured["peak_rss_mb"],
        },
        "load_average_start": [round(x, 1) for x in load_start],
        "load_average_end": [round(x, 1) for x in load_end],
    }
