"""Sealed secrets in a configuration overlay, against a real enrolled agent on the documented broker.

The device enrolls with a claim (its own P-256 key, a certificate from the fleet CA); the operator
seals a camera password to the public key of that certificate and publishes the overlay as a signed
``_config`` desired state. Values sealed to another device's key, moved to another key path, or
altered on the way are refused ``config_invalid`` and change nothing; the right one becomes a 0600
file the camera reads, and the clear value appears in no overlay, record or log.
"""

from __future__ import annotations

import base64
import secrets
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from agent.fleet.chunks.server import ChunkServer
from agent.fleet.deploy.keys import write_keypair
from agent.lifecycle.config.record import OverlayFiles
from agent.protocol.sealed import SEALED_PREFIX, seal
from tests.e2e.daemon import AgentFiles, unique_results
from tests.e2e.test_config_target import ConfigDesk, Device
from tests.e2e.test_enrollment import _device_config
from tests.enrollment.enrollment_fleet import PREFIX, EnrollmentFleet, start_fleet

pytestmark = pytest.mark.slow

DEVICE = "jet-sealed"
KEY_PATH = "streams.door.source.password"


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[EnrollmentFleet]:
    made = start_fleet(tmp_path / "fleet")
    yield made
    made.stop()


def _tampered(value: str) -> str:
    raw = bytearray(base64.urlsafe_b64decode(value[len(SEALED_PREFIX) :] + "=="))
    raw[70] ^= 0x01  # a byte of the nonce
    return SEALED_PREFIX + base64.urlsafe_b64encode(bytes(raw)).decode().rstrip("=")


def test_sealed_camera_password_opens_only_on_its_device_under_its_key(
    fleet: EnrollmentFleet, tmp_path: Path
) -> None:
    fleet.devices("register", {"device_id": DEVICE, "serial": None})
    files = AgentFiles(tmp_path / "device", fleet.broker.device_port, DEVICE, frames=30)
    keys = write_keypair(tmp_path / "keys", "k1")
    config = _device_config(fleet, files)
    config.write_text(config.read_text() + f"delivery: {{trusted_keys: {{k1: {keys.public}}}}}\n")
    probe = fleet.broker.operator()
    probe.subscribe(f"{PREFIX}/{DEVICE}/up/#")
    results = f"{PREFIX}/{DEVICE}/up/results/cam"
    with ChunkServer(fleet.operator_settings(), group=f"g-{uuid.uuid4().hex[:6]}") as server:
        desk = ConfigDesk(tmp_path, probe, server, DEVICE, keys.private.read_bytes())
        agent = Device(config, tmp_path)
        try:
            probe.wait_for(lambda ms: len(unique_results(ms, results)) >= 5, timeout=90)
            cert = x509.load_pem_x509_certificate((files.root / "tls" / "device.crt").read_bytes())
            device_key = cert.public_key()
            assert isinstance(device_key, ec.EllipticCurvePublicKey)
            clear = secrets.token_urlsafe(16).encode()
            other_device = ec.generate_private_key(ec.SECP256R1()).public_key()

            def door(password: str) -> dict[str, object]:
                source = {"type": "url", "url": "rtsp://viewer@127.0.0.1:9/door", "password": password}
                return {"streams": {"door": {"source": source, "slot": "cls"}}}

            right = seal(clear, device_key, DEVICE, KEY_PATH)
            attacks = {
                "another device's key": seal(clear, other_device, DEVICE, KEY_PATH),
                "sealed for another key": seal(clear, device_key, DEVICE, "streams.cam.source.password"),
                "altered": _tampered(right),
            }
            for what, value in attacks.items():
                job = desk.publish(door(value), f"attack-{len(what)}")
                final = desk.final(job)
                assert (final.state.value, final.error_code) == ("REJECTED", "config_invalid"), what
                assert KEY_PATH in (final.error or ""), what
            assert OverlayFiles(files.root / "state").read().active is None  # nothing changed
            assert agent.daemon.proc.poll() is None

            job = desk.publish(door(right), "door-1", probation_s=3)
            agent.restarted()  # a new stream needs a restart
            final = desk.final(job, timeout=90)
            assert final.state.value == "ACTIVE", final.error
            stored = OverlayFiles(files.root / "state")
            record = stored.read()
            assert record.active is not None
            secret = stored.secret_path(record.active.sha256, KEY_PATH)
            assert secret.read_bytes() == clear
            assert secret.stat().st_mode & 0o777 == 0o600
            overlay = stored.overlay_path(record.active.sha256).read_text()
            assert f"password_file: {secret}" in overlay
            # The camera reads the file at open (the port answers nothing: it fails, and says so redacted).
            assert agent.daemon.wait_for_event("camera.source.failed", timeout=60)["stream"] == "door"
        finally:
            agent.daemon.stop()
    on_disk = [p.read_bytes() for p in (files.root / "state" / "config").rglob("*") if p.is_file()]
    assert sum(clear in data for data in on_disk) == 1  # the secret file alone
    logs = b"".join(p.read_bytes() for p in tmp_path.glob("agent-*.log"))
    assert clear not in logs
