"""A real agent process with only a claim joins the fleet by itself, serves, and renews its certificate
while frames keep flowing: the broker of configs/mosquitto/ as written (devices, operators and
enrollment listeners, the fleet CA's CRL) and a real controller process with its enrollment desk.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.enrollment.certificate import held_certificate
from agent.fleet.ca.pki import CLOCK_SKEW
from agent.protocol.messages import InfoMessage, decode
from tests.e2e.daemon import REPO, AgentFiles, Daemon, unique_results
from tests.enrollment.enrollment_fleet import CLIENT_ID_PREFIX, PREFIX, EnrollmentFleet, start_fleet
from tests.mqtt_probe import Received
from tests.waiting import patient

pytestmark = pytest.mark.slow

DEVICE = "jet-enroll"
#: The controller issues certificates of a day here (its shortest); renewal is made due this many
#: seconds after one is issued, so the test sees it without waiting two thirds of a day.
RENEW_AFTER_S = 10.0


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[EnrollmentFleet]:
    made = start_fleet(tmp_path / "fleet")
    yield made
    made.stop()


def _device_config(fleet: EnrollmentFleet, files: AgentFiles) -> Path:
    """The device's agent.yaml: the claim, the trust anchors, where its own key and certificate go."""
    device_dir = files.root / "tls"
    life_s = 86400.0 + CLOCK_SKEW.total_seconds()
    return files.write_config(
        mqtt={
            "port": fleet.broker.device_port,
            "client_id_prefix": CLIENT_ID_PREFIX,
            "tls": {
                "ca_file": str(fleet.claim.ca_file),
                "cert_file": str(device_dir / "device.crt"),
                "key_file": str(device_dir / "device.key"),
            },
        },
        enrollment={
            "host": fleet.broker.host,
            "port": fleet.broker.enroll_port,
            "claim_cert_file": str(fleet.claim.cert_file),
            "claim_key_file": str(fleet.claim.key_file),
            "retry_min_s": 0.5,
            "retry_max_s": 2.0,
            "renewal": {"at_fraction": (CLOCK_SKEW.total_seconds() + RENEW_AFTER_S) / life_s},
        },
        stream={"source": {"type": "file", "path": str(files.video), "loop": True, "realtime": True},
                "durable_results": True},
    )  # fmt: skip


def test_a_device_with_only_a_claim_enrolls_serves_and_renews_while_frames_keep_flowing(
    fleet: EnrollmentFleet, tmp_path: Path
) -> None:
    fleet.devices("register", {"device_id": DEVICE, "serial": None})
    files = AgentFiles(tmp_path / "device", fleet.broker.device_port, DEVICE, frames=30)
    config = _device_config(fleet, files)
    cert_file = files.root / "tls" / "device.crt"
    assert not cert_file.exists()
    probe = fleet.broker.operator()
    probe.subscribe(f"{PREFIX}/{DEVICE}/up/#")
    results_topic = f"{PREFIX}/{DEVICE}/up/results/cam"
    daemon = Daemon(config, tmp_path / "agent.log")
    try:
        issued = daemon.wait_for_event("enrollment.issued", timeout=60)
        daemon.wait_for_event("agent.started", timeout=60)
        first = held_certificate(cert_file)
        assert first is not None
        assert first.serial == issued["serial"]
        assert (files.root / "tls" / "device.key").stat().st_mode & 0o777 == 0o600

        # Connected with its own certificate (the devices listener), it serves: results arrive.
        probe.wait_for(lambda msgs: len(unique_results(msgs, results_topic)) >= 10, timeout=60)

        daemon.wait_for_event("mqtt.certificate.moved", timeout=90)
        moved_at = len(unique_results(probe.snapshot(), results_topic))
        probe.wait_for(lambda msgs: len(unique_results(msgs, results_topic)) >= moved_at + 30, timeout=60)
        renewed = held_certificate(cert_file)
        assert renewed is not None
        assert renewed.serial != first.serial

        # up/info (retained) reports the certificate it connects with now; telemetry its days left.
        def info_renewed(msgs: list[Received]) -> bool:
            infos = [decode(InfoMessage, m.payload) for m in msgs if m.topic.endswith("/up/info")]
            return any(i.certificate is not None and i.certificate.serial != first.serial for i in infos)

        probe.wait_for(info_renewed, timeout=30)
        telemetry = probe.on_topic(f"{PREFIX}/{DEVICE}/up/telemetry")
        days = [json.loads(m.payload).get("cert.days_to_expiry") for m in telemetry]
        assert any(d is not None and 0.9 < d <= 1.01 for d in days), days
    finally:
        code = daemon.stop()
    assert code == 0, daemon.log()[-3000:]
    assert fleet.requests("/up/cert")  # the renewals went to the controller over the device's own link
    # No frame lost across the moves: durable results are numbered without a gap.
    frames = [r.frame_index for r in unique_results(probe.snapshot(), results_topic)]
    assert frames == list(range(frames[0], frames[0] + len(frames)))


def test_edge_agent_enroll_enrolls_once_by_hand_and_says_so(fleet: EnrollmentFleet, tmp_path: Path) -> None:
    fleet.devices("register", {"device_id": "jet-hand", "serial": None})
    files = AgentFiles(tmp_path / "device", fleet.broker.device_port, "jet-hand", frames=5)
    config = _device_config(fleet, files)
    command = [sys.executable, "-m", "agent", "enroll", "-c", str(config)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=patient(60), check=False)
    assert done.returncode == 0, done.stderr
    cert_file = files.root / "tls" / "device.crt"
    held = held_certificate(cert_file)
    assert held is not None
    assert f"jet-hand: enrolled, certificate {cert_file} serial {held.serial}" in done.stdout
    again = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=patient(60), check=False
    )
    assert again.returncode == 0
    assert held.serial in again.stdout  # already enrolled: the same certificate, no second request
    assert len(fleet.requests()) == 1


def test_a_pending_first_start_waits_quietly_and_stops_cleanly_on_sigterm(
    fleet: EnrollmentFleet, tmp_path: Path
) -> None:
    """Not registered: the controller holds it pending; the agent waits (no certificate, no serving)
    and SIGTERM ends the wait with exit 0, its key kept for the next start."""
    files = AgentFiles(tmp_path / "device", fleet.broker.device_port, "jet-wait", frames=5)
    config = _device_config(fleet, files)
    daemon = Daemon(config, tmp_path / "agent.log")
    try:
        answered = daemon.wait_for_event("enrollment.answered", timeout=60)
        assert answered["outcome"] == "pending"
        daemon.wait_for_event("enrollment.wait", timeout=60)
    finally:
        code = daemon.stop()
    assert code == 0, daemon.log()[-3000:]
    assert not (files.root / "tls" / "device.crt").exists()
    assert (files.root / "tls" / "device.key").stat().st_mode & 0o777 == 0o600
    assert "agent.started" not in daemon.log()
    assert "jet-wait" in str(fleet.devices("pending"))
