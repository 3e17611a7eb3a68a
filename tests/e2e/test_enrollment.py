"""A real agent process with only a claim joins the fleet by itself, serves, and renews its certificate
while frames keep flowing: a real mosquitto with the enrollment and devices listeners (TLS, the fleet
CA's CRL), the real fleet CA.

The operator side here is :class:`~tests.enrollment.fleet_pki.StandInDesk`, the real CA API answering
in place of the controller's admission desk.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from agent.demo.broker import Broker
from agent.enrollment.certificate import held_certificate
from agent.fleet.ca.pki import CLOCK_SKEW
from agent.protocol.messages import InfoMessage, decode
from tests.e2e.daemon import REPO, AgentFiles, Daemon, unique_results
from tests.enrollment.fleet_pki import PREFIX, FleetPki, StandInDesk, make_fleet_pki
from tests.mqtt_probe import Probe, Received
from tests.waiting import patient

pytestmark = pytest.mark.slow

DEVICE = "jet-enroll"
#: The certificate the stand-in desk issues lives a day (the CA's shortest); renewal is made due this
#: many seconds after it is issued, so the test sees it without waiting two thirds of a day.
RENEW_AFTER_S = 10.0


@pytest.fixture
def fleet(
    tmp_path: Path, broker_factory: Callable[[Sequence[str]], Broker]
) -> Iterator[tuple[FleetPki, StandInDesk]]:
    pki = make_fleet_pki(tmp_path / "fleet", broker_factory)
    desk = StandInDesk(pki, days=1)
    yield pki, desk
    desk.stop()


def _device_config(pki: FleetPki, files: AgentFiles, renewal: dict[str, object]) -> Path:
    device_dir = files.root / "tls"
    life_s = 86400.0 + CLOCK_SKEW.total_seconds()
    return files.write_config(
        mqtt={
            "port": pki.devices_port,
            "tls": {
                "ca_file": str(pki.claim.ca_file),
                "cert_file": str(device_dir / "device.crt"),
                "key_file": str(device_dir / "device.key"),
            },
        },
        enrollment={
            "host": "127.0.0.1",
            "port": pki.enroll_port,
            "claim_cert_file": str(pki.claim.cert_file),
            "claim_key_file": str(pki.claim.key_file),
            "retry_min_s": 0.5,
            "retry_max_s": 2.0,
            "renewal": {"at_fraction": (CLOCK_SKEW.total_seconds() + RENEW_AFTER_S) / life_s, **renewal},
        },
        stream={"source": {"type": "file", "path": str(files.video), "loop": True, "realtime": True},
                "durable_results": True},
    )  # fmt: skip


def test_a_device_with_only_a_claim_enrolls_serves_and_renews_while_frames_keep_flowing(
    fleet: tuple[FleetPki, StandInDesk], tmp_path: Path
) -> None:
    pki, desk = fleet
    files = AgentFiles(tmp_path / "device", pki.devices_port, DEVICE, frames=30)
    config = _device_config(pki, files, {})
    cert_file = files.root / "tls" / "device.crt"
    assert not cert_file.exists()
    probe = Probe(pki.broker.host, pki.broker.port)
    probe.subscribe(f"{PREFIX}/{DEVICE}/up/#")
    daemon = Daemon(config, tmp_path / "agent.log")
    try:
        issued = daemon.wait_for_event("enrollment.issued", timeout=60)
        daemon.wait_for_event("agent.started", timeout=60)
        first = held_certificate(cert_file)
        assert first is not None
        assert first.serial == issued["serial"]
        assert (files.root / "tls" / "device.key").stat().st_mode & 0o777 == 0o600

        # Connected with its own certificate (the devices listener), it serves: results arrive.
        results_topic = f"{PREFIX}/{DEVICE}/up/results/cam"
        probe.wait_for(lambda msgs: len(unique_results(msgs, results_topic)) >= 10, timeout=60)

        daemon.wait_for_event("mqtt.certificate.moved", timeout=90)
        moved_at = len(unique_results(probe.snapshot(), results_topic))
        probe.wait_for(lambda msgs: len(unique_results(msgs, results_topic)) >= moved_at + 30, timeout=60)
        renewed = held_certificate(cert_file)
        assert renewed is not None
        assert renewed.serial != first.serial

        # up/info (retained) reports the certificate it connects with now.
        def info_serial(msgs: list[Received]) -> bool:
            infos = [decode(InfoMessage, m.payload) for m in msgs if m.topic.endswith("/up/info")]
            return any(i.certificate is not None and i.certificate.serial != first.serial for i in infos)

        probe.wait_for(info_serial, timeout=30)
        telemetry = probe.on_topic(f"{PREFIX}/{DEVICE}/up/telemetry")
        days = [json.loads(m.payload).get("cert.days_to_expiry") for m in telemetry]
        assert any(d is not None and 0.9 < d <= 1.01 for d in days), days
    finally:
        code = daemon.stop()
    assert code == 0, daemon.log()[-3000:]
    assert desk.requests()  # the device asked the desk: enrollment, then renewals
    # No frame lost across the moves: durable results are numbered without a gap.
    frames = [r.frame_index for r in unique_results(probe.snapshot(), f"{PREFIX}/{DEVICE}/up/results/cam")]
    assert frames == list(range(frames[0], frames[0] + len(frames)))
    probe.close()


def test_edge_agent_enroll_enrolls_once_by_hand_and_says_so(
    fleet: tuple[FleetPki, StandInDesk], tmp_path: Path
) -> None:
    pki, _desk = fleet
    files = AgentFiles(tmp_path / "device", pki.devices_port, "jet-hand", frames=5)
    config = _device_config(pki, files, {})
    command = [sys.executable, "-m", "agent", "enroll", "-c", str(config)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=patient(60), check=False)
    assert done.returncode == 0, done.stderr
    held = held_certificate(files.root / "tls" / "device.crt")
    assert held is not None
    assert (
        f"jet-hand: enrolled, certificate {files.root / 'tls' / 'device.crt'} serial {held.serial}"
        in done.stdout
    )
    again = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=patient(60), check=False
    )
    assert again.returncode == 0
    assert held.serial in again.stdout  # already enrolled: the same certificate, no second request
    assert len(pki.authority.certificates_of("jet-hand")) == 1
