"""Days to certificate expiry on the operator side: a device's ``up/info`` names its certificate, and
the real controller's /metrics, ``fleet status`` and ``fleet devices enrolled`` say when it runs out."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509

from agent.cli import main
from agent.demo.broker import Broker
from agent.protocol.messages import CertificateInfo, InfoMessage, StatusMessage, encode
from agent.protocol.topics import Topics
from tests.fleet.enrollment.enroll_rig import EnrollRig, csr_pem, metric, new_key, signed_request, start_rig
from tests.waiting import wait_until


@pytest.fixture
def rig(tmp_path: Path, broker: Broker) -> Iterator[EnrollRig]:
    running = start_rig(tmp_path, broker)
    yield running
    running.probe.close()
    running.controller.kill()


def _announce(rig: EnrollRig, device: str, not_after: float | None) -> None:
    topics = Topics(rig.prefix, device)
    rig.probe.publish(
        topics.status, encode(StatusMessage(state="online", session=1, agent_version="t")), retain=True
    )
    certificate = None if not_after is None else CertificateInfo(serial="1f", not_after=not_after)
    info = InfoMessage(
        device_id=device, agent_version="t", platform={}, labels={}, backends={}, slots={}, streams=[],
        certificate=certificate,
    )  # fmt: skip
    rig.probe.publish(topics.info, encode(info), retain=True)


def test_days_to_expiry_show_on_metrics_in_fleet_status_and_in_the_enrolled_list(
    rig: EnrollRig, capsys: pytest.CaptureFixture[str]
) -> None:
    rig.operator("register", {"device_id": "cam-1"})
    reply = rig.ask(signed_request("cam-1", rig.claim(), csr_pem(new_key(), "cam-1")))
    not_after = x509.load_pem_x509_certificate(reply["cert_pem"].encode()).not_valid_after_utc.timestamp()
    _announce(rig, "cam-1", not_after)
    _announce(rig, "cam-2", time.time() + 36 * 3600)  # a day and a half left
    _announce(rig, "plain", None)  # plain TCP: no certificate, no series
    series = 'edge_device_certificate_expiry_timestamp_seconds{device="%s"}'
    wait_until(lambda: metric(rig.metrics(), series % "cam-2") > 0, timeout=30, what="the expiry series")
    text = rig.metrics()
    assert metric(text, series % "cam-1") == pytest.approx(not_after, abs=1)
    assert "plain" not in [
        line.split('"')[1] for line in text.splitlines() if line.startswith("edge_device_cert")
    ]
    wait = ["--retained-wait", "3", "--telemetry-wait", "0"]
    broker_args = ["--broker", f"{rig.broker.host}:{rig.broker.port}", "--prefix", rig.prefix]
    assert main(["fleet", "status", *wait, *broker_args]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-1] == "CERT"
    cells = {line.split()[0]: line.split()[-1] for line in lines[1:]}
    assert (cells["cam-1"], cells["cam-2"], cells["plain"]) == ("30d", "36h", "-")
    assert main(["fleet", "status", "--json", *wait, *broker_args]) == 0
    rows = {r["device"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["cam-1"]["cert_not_after"] == pytest.approx(not_after)
    assert main(["fleet", "devices", "enrolled", *broker_args]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[-1] in ("29.9", "30.0")
