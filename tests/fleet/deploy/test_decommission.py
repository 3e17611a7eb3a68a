"""``fleet decommission`` and the console's Decommission action, against a real mosquitto and a real
controller (in this process, its loop in a thread, its console on a real port).

A paho probe plays the devices: it leaves the retained messages an agent and a deploy leave (status,
info, a slot's desired state); the command clears them on the broker and the controller's view
forgets the device, so the console answers 404 for it and ``fleet status`` no longer lists it.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.cli import main
from agent.demo.broker import Broker, free_port
from agent.fleet.controller.config import ControllerConfig, HttpSettings
from agent.protocol.messages import StatusMessage, encode
from agent.protocol.topics import Topics
from tests.fleet.console_rig import info
from tests.fleet.controller.test_process import Running
from tests.fleet.operator_side import operator_settings, unique_prefix
from tests.mqtt_probe import Probe
from tests.waiting import patient, wait_until

TOKEN_TEXT = "a token of this test only"
DOCS = Path(__file__).resolve().parents[3] / "docs"


def _doc_block(doc: str, language: str, starts: str) -> str:
    """The ```language block of docs/``doc`` whose text starts with ``starts``."""
    text = (DOCS / doc).read_text(encoding="utf-8")
    match = re.search(rf"```{language}\n({re.escape(starts)}.*?)```", text, re.DOTALL)
    assert match, f"docs/{doc} has no {language} block starting {starts!r}"
    return match.group(1)


@pytest.fixture
def prefix() -> str:
    return unique_prefix()


@pytest.fixture
def running(tmp_path: Path, broker: Broker, prefix: str) -> Iterator[Running]:
    token = tmp_path / "console.token"
    token.write_text(TOKEN_TEXT + "\n")
    token.chmod(0o600)
    config = ControllerConfig(
        mqtt=operator_settings(broker, prefix),
        state_dir=tmp_path / "controller",
        unsigned=True,
        http=HttpSettings(port=free_port(), token_file=token),
    )
    controller = Running(config)
    yield controller
    controller.stop()


def _leave_retained(probe: Probe, prefix: str, device: str, state: str) -> Topics:
    """What an agent and a deploy leave on the broker: status, info, one slot's desired state."""
    topics = Topics(prefix, device)
    probe.publish(
        topics.status, encode(StatusMessage(state=state, session=3, agent_version="0.3.1")), retain=True
    )
    probe.publish(*info(prefix, device), retain=True)
    probe.publish(topics.desired("main"), b'{"manifest": "{}", "signature": null}', retain=True)
    return topics


def _retained(broker: Broker, topic_filter: str) -> list[str]:
    """The topics under ``topic_filter`` that still hold a retained message (a fresh subscriber's view)."""
    with Probe(broker.host, broker.port) as reader:
        reader.subscribe(topic_filter)
        reader.settle(0.5)
        return sorted(m.topic for m in reader.snapshot() if m.retain and m.payload)


def _post(url: str, token: str | None) -> tuple[int, dict[str, object]]:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    request = urllib.request.Request(url, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=patient(30)) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _status_code(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=patient(10)) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_command_clears_the_retained_topics_and_the_controller_forgets_the_device(
    broker: Broker, prefix: str, running: Running, capsys: pytest.CaptureFixture[str]
) -> None:
    view = running.controller.view
    url = running.controller.http.url
    broker_args = ["--broker", f"{broker.host}:{broker.port}", "--prefix", prefix]
    with Probe(broker.host, broker.port) as probe:
        gone = _leave_retained(probe, prefix, "jet-gone", "offline")
        _leave_retained(probe, prefix, "jet-live", "online")
    wait_until(lambda: len(view.devices()) == 2, what="both devices in the controller's view")
    assert _status_code(f"{url}/api/device/jet-gone") == 200

    code = main(["fleet", "decommission", "jet-gone", "--json", *broker_args])
    out = json.loads(capsys.readouterr().out)

    assert code == 0
    assert out == {
        "device": "jet-gone",
        "state": "offline",
        "cleared": sorted([gone.desired("main"), gone.info, gone.status]),
    }
    assert _retained(broker, f"{prefix}/jet-gone/#") == []
    wait_until(lambda: view.device("jet-gone") is None, what="the controller forgets jet-gone")
    assert _status_code(f"{url}/api/device/jet-gone") == 404
    assert [d.device for d in view.devices()] == ["jet-live"]
    assert main(["fleet", "status", "--json", "--wait", "2", "--telemetry-wait", "0", *broker_args]) == 0
    assert [row["device"] for row in json.loads(capsys.readouterr().out)] == ["jet-live"]

    # A typo clears nothing and says so.
    assert main(["fleet", "decommission", "jet-g0ne", *broker_args]) == 1
    assert "nothing retained for jet-g0ne under" in capsys.readouterr().err

    # An online device is refused (its agent would announce itself again); --force clears it anyway.
    assert main(["fleet", "decommission", "jet-live", *broker_args]) != 0
    assert "device jet-live is online" in capsys.readouterr().err
    assert len(_retained(broker, f"{prefix}/jet-live/#")) == 3
    assert main(["fleet", "decommission", "jet-live", "--force", *broker_args]) == 0
    assert "decommissioned jet-live (its status said online)" in capsys.readouterr().out
    wait_until(lambda: view.devices() == [], what="the controller forgets jet-live")


def test_the_console_action_needs_the_token_and_decommissions_through_the_controller(
    broker: Broker, prefix: str, running: Running
) -> None:
    view = running.controller.view
    url = running.controller.http.url
    with Probe(broker.host, broker.port) as probe:
        _leave_retained(probe, prefix, "jet-07", "offline")
        _leave_retained(probe, prefix, "jet-on", "online")
    wait_until(lambda: len(view.devices()) == 2, what="both devices in the controller's view")

    without = _post(f"{url}/api/devices/jet-07/decommission", None)
    online = _post(f"{url}/api/devices/jet-on/decommission", TOKEN_TEXT)
    done = _post(f"{url}/api/devices/jet-07/decommission", TOKEN_TEXT)

    assert without[0] == 401
    assert online[0] == 409
    assert "device jet-on is online" in str(online[1]["error"])
    assert done == (
        200,
        json.loads(_doc_block("console.md", "json", '{"ok": true, "message": "device jet-07')),
    )
    assert view.device("jet-07") is None  # forgotten at once, not only when the cleared status arrives
    assert _status_code(f"{url}/api/device/jet-07") == 404
    assert _retained(broker, f"{prefix}/jet-07/#") == []
    assert len(_retained(broker, f"{prefix}/jet-on/#")) == 3


def test_the_documented_decommission_is_what_the_command_prints(
    broker: Broker, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    example = _doc_block("fleet.md", "sh", "edge-agent fleet decommission jet-07")
    command, *printed = example.splitlines()
    with Probe(broker.host, broker.port) as probe:
        _leave_retained(probe, prefix, "jet-07", "offline")

    code = main([*command.split()[1:], "--broker", f"{broker.host}:{broker.port}", "--prefix", prefix])

    assert code == 0
    expected = [line.removeprefix("# ").replace("fleet/v1/", f"{prefix}/") for line in printed]
    assert capsys.readouterr().out.splitlines() == expected


def test_every_flag_docs_fleet_md_gives_decommission_is_one_it_takes() -> None:
    from tests.cli.parser_walk import commands, options

    section = (DOCS / "fleet.md").read_text(encoding="utf-8").split("## Decommissioning a device\n", 1)[1]
    named = set(re.findall(r"`(--[a-z-]+)", section.split("\n## ", 1)[0]))
    parser = dict(commands())["fleet decommission"]
    taken = {s for action in options(parser) for s in action.option_strings}
    assert "--retained-wait" in named
    assert named <= taken, f"docs/fleet.md names {named - taken} for fleet decommission"
