"""``fleet status``: rows from retained status and info, table and JSON."""

from __future__ import annotations

import time

from agent.fleet.status import age, collect_fleet, format_table
from agent.localbroker import Broker
from agent.protocol.messages import InfoMessage, ModelRef, SlotInfo, StatusMessage, encode
from agent.protocol.topics import Topics
from tests.fleet.operator_side import operator_settings, unique_prefix
from tests.mqtt_probe import Probe


def test_devices_from_retained_status_and_info(broker: Broker) -> None:
    prefix = unique_prefix()
    a, b = Topics(prefix, "jet-a"), Topics(prefix, "jet-b")
    info = InfoMessage(
        device_id="jet-a",
        agent_version="9.9",
        platform={"device_model": "Orin NX", "jetpack": "6.0", "tensorrt_version": "8.6.2", "dla_cores": 2},
        backends={},
        slots={
            "cls": SlotInfo(
                model=ModelRef(slot="cls", model_id="net", version="4", sha256="ab" * 32),
                state="ACTIVE",
                last_job="job-4",
            ),
            "aux": SlotInfo(state="empty", reason="model file /opt/aux.onnx not found"),
        },
        streams=["cam"],
    )
    with Probe(broker.host, broker.port) as device:
        device.publish(
            a.status, encode(StatusMessage(state="online", session=3, agent_version="9.9")), retain=True
        )
        device.publish(a.info, encode(info), retain=True)
        device.publish(
            b.status, encode(StatusMessage(state="offline", session=1, agent_version="9.8")), retain=True
        )
        device.publish(b.info, b"{not json", retain=True)

    rows = collect_fleet(operator_settings(broker, prefix), quiet_s=0.3)

    assert [r.device for r in rows] == ["jet-a", "jet-b"]
    jet_a, jet_b = rows
    assert (jet_a.state, jet_a.session, jet_a.agent_version) == ("online", 3, "9.9")
    assert jet_a.slots["cls"]["version"] == "4"
    assert (jet_b.state, jet_b.agent_version) == ("offline", "9.8")
    assert jet_b.problems
    assert jet_b.problems[0].startswith("info:")
    table = format_table(rows, now=time.time())
    lines = table.splitlines()
    assert lines[0].split()[:2] == ["DEVICE", "STATUS"]
    assert "cls=net:4" in lines[1]
    assert "aux=empty" in lines[1]  # not "aux=-:-"
    assert "jet-a: slot aux is empty: model file /opt/aux.onnx not found" in lines
    assert "cls=job-4" in lines[1]
    assert "Orin NX, JetPack 6.0, TRT 8.6.2, 2 DLA" in lines[1]
    assert lines[2].startswith("jet-b")
    assert " offline " in lines[2]
    assert jet_a.as_dict()["slots"]["cls"]["last_job"] == "job-4"


def test_age() -> None:
    assert [age(s) for s in (5, 125, 7300, 90000)] == ["5s", "2m05s", "2h01m", "1d01h"]
