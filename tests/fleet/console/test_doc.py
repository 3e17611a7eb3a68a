"""docs/console.md shows what a real controller's console answers.

The examples used to be checked against a console over hand-built store rows (a ``spec`` and wave
figures no controller writes, a failure code no device sends), which let them drift. Here a real
:class:`FleetController` serves the console on a free port and runs a real rollout, over a real
mosquitto, to scripted devices (tests/fleet/scripted_fleet.py: stand-ins for a simulated fleet's
devices) with shadow and probation on: waves ``2,100%``, one canary rolled back by its probation
(``unhealthy``), the last device offline so the second wave is still running. Then every ```json
block of docs/console.md is checked against its real counterpart, found by the section it is in:

* the same keys at every level (values may differ; a JSON type may not, but null may stand for any);
* maps keyed by data (``labels``, ``models``, counts by ``steps``/``ends``) have keys of that kind;
* a list's items are checked against the real item at the same index;
* every failure ``code``/``error_code`` in an example is one docs/fleet.md "Error codes" lists;
* a refusal is exactly the server's own text;
* a ```json block in a section this test does not know fails the test: every example is checked.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.demo.broker import Broker, free_port
from agent.errors import ConfigError
from agent.fleet.console import console_token
from agent.fleet.controller.client import ControllerClient
from agent.fleet.controller.config import ControllerConfig, HttpSettings
from agent.fleet.controller.process import FleetController
from agent.fleet.rollout.gate import DeviceEnd
from agent.fleet.rollout.records import DeviceStep
from agent.fleet.rollout.status_model import BuildingDevice
from agent.fleet.view.build_note import build_note
from agent.fsutil import sha256_file
from agent.protocol.device_targets import TargetInfo
from agent.protocol.messages import BuildProgressInfo, JobState
from tests.fleet.console_rig import telemetry
from tests.fleet.operator_side import operator_settings, tiny_model, unique_prefix
from tests.fleet.scripted_fleet import ScriptedFleet
from tests.mqtt_probe import Probe
from tests.waiting import patient, wait_until

REPO = Path(__file__).resolve().parents[3]
DOC = (REPO / "docs" / "console.md").read_text(encoding="utf-8")
FLEET_DOC = (REPO / "docs" / "fleet.md").read_text(encoding="utf-8")
DEVICES = ["jet-01", "jet-02", "jet-03", "jet-04"]
ROLLOUT = "r-2026-05"

#: Maps whose keys are data, not field names, and what a key of each must be.
STEP_NAMES = {s.value for s in DeviceStep}
END_NAMES = {e.value for e in DeviceEnd}
DATA_KEYS: dict[str, set[str] | None] = {
    "labels": None,  # the operator's label names
    "models": None,  # the device's slot names
    "steps": STEP_NAMES,
    "ends": END_NAMES,
    "baseline": None,  # probation figures by name
    "current": None,
}


def documented_codes() -> set[str]:
    """The failure codes docs/fleet.md "Error codes" lists (first column of its table)."""
    section = FLEET_DOC.split("\n## Error codes\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return {code for cell in rows for code in re.findall(r"`([a-z_]+)`", cell)}


@dataclass(frozen=True)
class Example:
    """One ```json block of docs/console.md: the headings above it and the value."""

    section: str  # the nearest ``##`` heading
    heading: str  # the nearest heading of any level
    value: Any


def doc_examples() -> list[Example]:
    examples: list[Example] = []
    section = heading = ""
    for block in re.split(r"(?m)^(#{2,3} .*)$", DOC):
        if block.startswith("## "):
            section = heading = block[3:].strip()
        elif block.startswith("### "):
            heading = block[4:].strip()
        else:
            found = re.findall(r"```json\n(.*?)\n```", block, re.S)
            examples.extend(Example(section, heading, json.loads(text)) for text in found)
    return examples


def _kind(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean"}.get(
        type(value), "number" if isinstance(value, (int, float)) else "null"
    )


def shape_problems(doc: Any, real: Any, path: str = "") -> list[str]:
    """Where ``doc`` differs from ``real`` in keys or JSON types (module docstring's rules)."""
    if doc is None or real is None:
        # null stands for any value (a figure not measured yet), but not for an object's keys.
        if isinstance(doc, dict) or isinstance(real, dict):
            return [f"{path or '.'}: the doc has {_kind(doc)}, the console sends {_kind(real)}"]
        return []
    if _kind(doc) != _kind(real):
        return [f"{path or '.'}: the doc has {_kind(doc)}, the console sends {_kind(real)}"]
    if isinstance(doc, list):
        if not real:
            return [f"{path}: the console sent an empty list here: nothing to check the doc against"]
        return [
            p
            for i, item in enumerate(doc)
            for p in shape_problems(item, real[min(i, len(real) - 1)], f"{path}[{i}]")
        ]
    if not isinstance(doc, dict):
        return []
    name = path.rsplit(".", 1)[-1]
    if name in DATA_KEYS:
        allowed = DATA_KEYS[name]
        return [
            f"{path}: {key!r} is not one of {sorted(allowed)}"
            for key in doc
            if allowed and key not in allowed
        ]
    problems = []
    if set(doc) != set(real):
        missing, extra = sorted(set(real) - set(doc)), sorted(set(doc) - set(real))
        problems.append(f"{path or '.'}: keys the doc lacks {missing}, keys the console never sends {extra}")
    for key in sorted(set(doc) & set(real)):
        problems += shape_problems(doc[key], real[key], f"{path}.{key}")
    return problems


def codes_in(value: Any) -> list[str]:
    """Every failure code in an example: values of ``code`` and ``error_code`` keys, at any depth."""
    if isinstance(value, dict):
        own = [v for k, v in value.items() if k in ("code", "error_code") and isinstance(v, str)]
        return own + [c for v in value.values() for c in codes_in(v)]
    if isinstance(value, list):
        return [c for v in value for c in codes_in(v)]
    return []


class RealConsole:
    """What the real controller's console answered once the scenario stood still."""

    def __init__(self, url: str, paths: set[str]) -> None:
        self.url = url
        self.paths = paths  # the app's route paths

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=patient(10)) as response:
            return json.loads(response.read())

    def ask(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, Any]:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        connection = http.client.HTTPConnection(host, int(port), timeout=patient(10))
        try:
            connection.request(method, path, headers=headers)
            response = connection.getresponse()
            return response.status, json.loads(response.read())
        finally:
            connection.close()


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory, broker: Broker) -> Iterator[RealConsole]:
    root = tmp_path_factory.mktemp("console-doc")
    prefix = unique_prefix()
    settings = operator_settings(broker, prefix)
    # Read-only (no token file): the doc's 403 example is this controller's answer.
    config = ControllerConfig(
        mqtt=settings, state_dir=root / "controller", unsigned=True, http=HttpSettings(port=free_port())
    )
    controller = FleetController(config).start()
    stop = threading.Event()
    loop = threading.Thread(target=controller.run, args=(stop,), daemon=True)
    loop.start()
    fleet = ScriptedFleet(
        broker,
        prefix,
        DEVICES,
        slot="main",
        model={"model_id": "mobilenet", "version": "4", "sha256": "ab" * 32},
    )
    for scripted in fleet.devices.values():
        scripted.labels = {"site": "berlin"}
        scripted.config = TargetInfo(version="cfg-6", job_id="config-cfg-6-x", pending="cfg-7")
        scripted.agent_release = TargetInfo(version="0.3.1")
    # The second canary's probation fails: ROLLED_BACK, code ``unhealthy``, as an agent sends it.
    fleet.devices["jet-02"].end = JobState.ROLLED_BACK
    fleet.devices["jet-02"].error_code = "unhealthy"
    fleet.devices["jet-04"].online = False  # the second wave waits for it: the rollout stays RUNNING
    model = tiny_model(root / "mobilenet.onnx")
    try:
        with fleet, Probe(broker.host, broker.port) as probe:
            for device in DEVICES:
                probe.publish(*telemetry(prefix, device, fps=25.0))
            body: dict[str, Any] = {
                "rollout_id": ROLLOUT,
                "model_sha256": sha256_file(model),
                "model_name": model.name,
                "model_id": "mobilenet",
                "slot": "main",
                "version": "5",
                "devices": DEVICES,
                "waves": "2,100%",
                "max_failed": "1",
                "chunk_size": 4096,
                "shadow": {"frames": 30, "min_agreement": 0.9},
                "probation_s": 60,
            }
            with ControllerClient(settings, timeout=20) as client:
                client.upload(model, body["model_sha256"])
                client.request("start", body)
            console = RealConsole(
                controller.http.url, {getattr(r, "path", "") for r in controller.http.app.routes}
            )

            def settled() -> bool:
                rollout = console.get(f"/api/rollout/{ROLLOUT}")
                ended = {r["device"] for r in rollout["device_rows"] if r["step"] == "ENDED"}
                jobs = {d["id"]: d["job"] for d in console.get("/api/devices")["devices"]}
                return ended == {"jet-01", "jet-02", "jet-03"} and all(jobs[d] for d in sorted(ended))

            wait_until(settled, timeout=60, what="the first wave done and jet-03 ended")
            wait_until(
                lambda: all(d["fps"] for d in console.get("/api/devices")["devices"]), what="telemetry"
            )
            yield console
    finally:
        stop.set()
        loop.join(patient(10))
        controller.stop()


def test_every_json_example_has_the_keys_of_the_real_answer(real: RealConsole) -> None:
    devices = real.get("/api/devices")["devices"]
    rollout = real.get(f"/api/rollout/{ROLLOUT}")
    summary = real.get("/api/rollouts")["rollouts"][0]
    checked = []
    for example in doc_examples():
        doc = example.value
        if example.heading == "A device row":
            # Against the real row whose last job ended as the example's did.
            (real_row,) = [r for r in devices if (r["job"] or {}).get("state") == doc["job"]["state"]]
            problems = shape_problems(doc, real_row)
        elif example.heading == "A rollout summary":
            # The scripted devices walk BUILDING at once, so no real summary lists a build: its item
            # is checked against the model every real one validates against (test_building.py).
            assert "building" in summary
            problems = shape_problems(_without_building(doc), _without_building(summary))
            problems += [p for item in doc["building"] for p in building_problems(item)]
        elif example.heading == "A rollout's device":
            (real_row,) = [r for r in rollout["device_rows"] if r["end"] == doc["end"]]
            problems = shape_problems(doc, real_row)
        elif example.section == "The token":
            code, answer = real.ask("POST", f"/api/rollouts/{ROLLOUT}/pause", {"Authorization": "Bearer x"})
            problems = [] if (code, answer) == (403, doc) else [f"the console answers {code} {answer}"]
        elif example.section == "Which Host it answers":
            code, answer = real.ask("GET", "/api/devices", {"Host": "evil.example:8080"})
            problems = [] if (code, answer) == (403, doc) else [f"the console answers {code} {answer}"]
        elif example.section == "Decommissioning a device":
            # This read-only console has no token: the answer is compared whole, through a console
            # with one, by tests/fleet/deploy/test_decommission.py (the console action's test).
            problems = [] if set(doc) == {"ok", "message"} else [f"keys {sorted(doc)}"]
        else:
            problems = ["no check for this example: add one to tests/fleet/console/test_doc.py"]
        assert not problems, f"docs/console.md, {example.heading!r}: " + "; ".join(problems)
        checked.append(example.heading)
    assert {"A device row", "A rollout summary"} <= set(checked)


def _without_building(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k != "building"}


def building_problems(item: dict[str, Any]) -> list[str]:
    """Why ``item`` is not a building device as the controller writes it (its note build_note's)."""
    try:
        entry = BuildingDevice.model_validate(item)
    except ValueError as exc:
        return [f"building: {exc}"]
    progress = BuildProgressInfo.model_validate(
        entry.model_dump(exclude={"device", "wave", "note"}, exclude_none=True)
    )
    return [] if entry.note == build_note(progress) else [f"building: note {entry.note!r}"]


def test_every_failure_code_in_an_example_is_a_documented_code() -> None:
    codes = documented_codes()
    assert {"unhealthy", "shadow_disagrees", "transfer_timeout"} <= codes  # the table was read
    used = [c for example in doc_examples() for c in codes_in(example.value)]
    assert used, "no example shows a failure code"
    assert set(used) <= codes, f"not in docs/fleet.md 'Error codes': {sorted(set(used) - codes)}"


def test_the_api_table_names_the_keys_of_the_real_device_answer(real: RealConsole) -> None:
    row = re.search(r"^\| `GET /api/device/ID` \| (.*) \|$", DOC, re.M)
    assert row, "docs/console.md's API table has no /api/device/ID row"
    named = set(re.findall(r"`([a-z_]+)`", row.group(1).split("(columns", 1)[0]))
    columns = set(re.findall(r"`([a-z_0-9]+)`", row.group(1).split("(columns", 1)[1]))
    answer = real.get("/api/device/jet-02")
    assert named == set(answer)
    assert columns == set(answer["history"])


def test_the_console_yaml_example_is_a_valid_http_section() -> None:
    (block,) = re.findall(r"```yaml\n(.*?)```", DOC, re.S)
    settings = HttpSettings.model_validate(yaml.safe_load(block)["http"])
    assert settings.port == 8080
    assert settings.allowed_hosts == ["fleet.example.com"]


def test_the_token_file_is_read_as_a_secret(tmp_path: Path) -> None:
    token_file = tmp_path / "console.token"
    token_file.write_text("abc123\n")
    token_file.chmod(0o600)

    assert console_token(token_file) == "abc123"
    assert console_token(None) is None
    with pytest.raises(ConfigError, match="cannot read secret file"):
        console_token(tmp_path / "missing")
    assert "head -c 32 /dev/urandom | base64 > /etc/edge-fleet-controller/console.token" in DOC


def test_the_doc_names_every_route_the_app_serves(real: RealConsole) -> None:
    for route in ("/api/devices", "/api/device/ID", "/api/rollouts", "/api/rollout/ID", "/events"):
        assert f"`GET {route}" in DOC, route
    assert {"/api/devices", "/api/device/{device_id}", "/api/rollout/{rollout_id}", "/events"} <= real.paths
