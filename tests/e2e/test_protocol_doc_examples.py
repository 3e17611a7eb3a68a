"""docs/protocol.md's examples have exactly the keys of what a real device sends.

The examples used to be built from the message models (tests/protocol/examples.py), which let them
drift from the device: a model field is optional, a platform or telemetry name is a free-form key.
Here a real daemon runs against a real mosquitto, a real ``fleet deploy`` gives it a model, a signed
manifest for another device is refused, and ``rollback`` is asked twice (a result, then an error);
every message it publishes, and what the operator side sends it, is collected. Each documented
example must then have the key set of its real counterpart, nested objects included:

* the same keys, recursively (``platform``, a slot, ``model``, ``latency_ms``, a class score ...);
* maps keyed by names the operator chooses (``slots``, ``backends``) match entry by entry;
* telemetry is an excerpt (the doc says so): each documented name is one the device sends;
* a platform value the device could not read is left out and ``<name>_reason`` says why (the doc
  shows a Jetson that reads all of them): ``x_reason`` counts as ``x``.
"""

from __future__ import annotations

import base64
import json
import re
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.demo.broker import Broker
from agent.fleet.deploy.keys import KeyPairFiles, load_signing_key, write_keypair
from agent.fleet.deploy.plan import DeployPlan
from agent.fleet.deploy.run import FleetDeploy
from agent.fleet.devices.command import send_command
from agent.mqtt.settings import MqttSettings
from agent.protocol.manifest import KIB, build_manifest, sign_manifest
from agent.protocol.topics import Topics
from agent.specs.build import BuildSpec
from tests.e2e.daemon import AgentFiles, Daemon
from tests.mqtt_probe import Probe, Received
from tests.once_per_run import once_per_run
from tests.waiting import patient

pytestmark = pytest.mark.slow

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def doc_examples(heading: str) -> list[dict[str, Any]]:
    """Every ```json block under ``### heading`` in docs/protocol.md, parsed, in order."""
    text = DOC.read_text()
    match = re.search(rf"^### {heading}\n(.*?)(?=^#)", text + "\n#", re.S | re.M)
    assert match, f"docs/protocol.md has no '### {heading}' section"
    blocks = re.findall(r"```json\n(.*?)```", match.group(1), re.S)
    assert blocks, f"docs/protocol.md's '### {heading}' has no ```json example"
    return [json.loads(block) for block in blocks]


def _keys(value: Any) -> Any:
    """The key structure of a JSON value: dicts by key, a list by its first item's keys."""
    if isinstance(value, dict):
        return {k: _keys(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_keys(value[0])] if value else []
    return None


def _platform_names(platform: dict[str, Any]) -> set[str]:
    """Platform keys, ``x_reason`` (x could not be read) counted as ``x``; backend reasons stay."""
    return {k if k.startswith("backend_") else k.removesuffix("_reason") for k in platform}


class RealDevice:
    """What one real daemon published (and was sent) during the scenario, decoded."""

    def __init__(self, messages: list[Received], topics: Topics) -> None:
        self.messages = messages
        self.topics = topics

    def on(self, topic: str) -> list[dict[str, Any]]:
        out = []
        for m in self.messages:
            if m.topic == topic and m.payload:
                payload: dict[str, Any] = json.loads(m.payload)
                out.append(payload)
        return out

    def jobs(self) -> list[dict[str, Any]]:
        prefix = self.topics.jobs("x").removesuffix("x")
        return [json.loads(m.payload) for m in self.messages if m.topic.startswith(prefix)]


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory, broker: Broker) -> RealDevice:
    """The scenario's messages: played once per run, the workers of a parallel run share them."""

    def play() -> bytes:
        return _dump(_play_scenario(tmp_path_factory.mktemp("doc-device"), broker))

    return _load(once_per_run(tmp_path_factory, "protocol-doc-device", play))


def _dump(device: RealDevice) -> bytes:
    return json.dumps(
        {
            "device": device.topics.device_id,
            "messages": [
                [m.topic, base64.b64encode(m.payload).decode(), m.qos, m.retain] for m in device.messages
            ],
        }
    ).encode()


def _load(data: bytes) -> RealDevice:
    stored = json.loads(data)
    messages = [
        Received(topic, base64.b64decode(payload), qos, retain)
        for topic, payload, qos, retain in stored["messages"]
    ]
    return RealDevice(messages, Topics("fleet/v1", stored["device"]))


def _play_scenario(root: Path, broker: Broker) -> RealDevice:
    """A real daemon serving, deployed to, refusing a manifest, asked to roll back twice: all it sent."""
    device = f"doc-{uuid.uuid4().hex[:8]}"
    keys: KeyPairFiles = write_keypair(root / "keys", "doc-key")
    files = AgentFiles(root, broker.port, device, frames=30)
    files.write_config(
        stream={"source": {"type": "file", "path": str(files.video), "loop": True, "realtime": True}},
        delivery={"trusted_keys": {keys.key_id: str(keys.public)}},
    )
    # The doc's names: slot main (serving), slot aux (its model file missing: empty), stream cam0.
    config = yaml.safe_load(files.config_path.read_text())
    config["slots"] = {"main": config["slots"]["cls"], "aux": {**config["slots"]["cls"]}}
    config["slots"]["aux"]["model"] = str(root / "aux.onnx")
    config["streams"] = {"cam0": {**config["streams"]["cam"], "slot": "main"}}
    config["labels"] = {"site": "berlin-3", "camera": "dock", "hw": "orin-nx"}  # the doc's labels
    files.config_path.write_text(yaml.safe_dump(config))
    topics = Topics("fleet/v1", device)
    settings = MqttSettings(host=broker.host, port=broker.port, reconnect_min_s=0.2, reconnect_max_s=1.0)
    with Probe(broker.host, broker.port) as probe:
        probe.subscribe(f"fleet/v1/{device}/#")
        daemon = Daemon(files.config_path, root / "agent.log")
        try:
            probe.wait_for(lambda ms: any(m.topic == topics.telemetry for m in ms), timeout=60)
            probe.wait_for(lambda ms: any(m.topic == topics.results("cam0") for m in ms), timeout=60)
            plan = DeployPlan(
                model=files.v2, devices=(device,), slot="main", version="2", model_id="cls",
                chunk_size=4 * KIB, build=BuildSpec(precision="fp32", device="cpu"),
            )  # fmt: skip
            deploy = FleetDeploy(
                settings, plan, signing_key=load_signing_key(keys.private), key_id=keys.key_id
            ).start()
            try:
                outcome = deploy.wait(patient(60))
            finally:
                deploy.stop()
            assert outcome.ok, outcome.failures()
            # A manifest for another device: REJECTED wrong_device, with error_code and error.
            other = build_manifest(
                files.v1, job_id="doc-refused", sequence=10**6, slot="main", model_id="cls", version="9",
                chunk_size=4 * KIB, device="another-device",
            )  # fmt: skip
            probe.publish(
                topics.desired("main"), sign_manifest(other, load_signing_key(keys.private), keys.key_id)
            )
            probe.wait_for(lambda ms: any(m.topic == topics.jobs("doc-refused") for m in ms), timeout=30)
            # The same manifest on the other slot's topic: that job id has its end already.
            probe.publish(
                topics.desired("aux"), sign_manifest(other, load_signing_key(keys.private), keys.key_id)
            )
            assert send_command(settings, device, "rollback", {"slot": "main"}).ok
            assert not send_command(settings, device, "rollback", {"slot": "main"}).ok
            assert send_command(settings, device, "status").ok
            probe.wait_for(lambda ms: any(m.topic == topics.info for m in ms), timeout=30)
        finally:
            assert daemon.stop() == 0, daemon.log()[-3000:]
        return RealDevice(probe.snapshot(), topics)


def _one_matches(doc: dict[str, Any], real: list[dict[str, Any]], what: str) -> None:
    """``doc`` has exactly the key structure of at least one of the ``real`` messages."""
    assert real, f"the device sent no {what}"
    shapes = [_keys(r) for r in real]
    assert _keys(doc) in shapes, (
        f"docs/protocol.md's {what} example has keys {sorted(doc)}; the device sends e.g. {real[0]}"
    )


def test_status_example_is_what_the_device_sends(real: RealDevice) -> None:
    (doc,) = doc_examples("StatusMessage")
    _one_matches(doc, real.on(real.topics.status), "StatusMessage")


def test_info_example_is_what_the_device_sends(real: RealDevice) -> None:
    (doc,) = doc_examples("InfoMessage")
    info = real.on(real.topics.info)[-1]
    assert set(doc) == set(info)
    assert _platform_names(doc["platform"]) == _platform_names(info["platform"])
    assert doc["labels"] == info["labels"]  # from the config, as written there
    # The doc shows a device that read every value; null + <name>_reason is said in the text.
    assert not [k for k in doc["platform"] if k.endswith("_reason") and not k.startswith("backend_")]
    assert set(doc["backends"]) == set(info["backends"])
    for name, backend in doc["backends"].items():
        assert set(backend) == set(info["backends"][name]), name
    # Slots by role: one serving a model, one empty (its model file missing), as on the device.
    assert _keys(doc["slots"]["main"]) == _keys(info["slots"]["main"])
    assert _keys(doc["slots"]["aux"]) == _keys(info["slots"]["aux"])
    assert doc["streams"] == info["streams"]
    # The doc's camera was lost once (last_error); the device's never was: its keys are a subset.
    assert set(doc["cameras"]) == set(info["cameras"])
    assert set(info["cameras"]["cam0"]) == {"state", "since", "frames", "reconnects"}
    assert set(doc["cameras"]["cam0"]) == {*info["cameras"]["cam0"], "last_error", "last_error_at"}


def test_telemetry_example_is_an_excerpt_of_what_the_device_sends(real: RealDevice) -> None:
    (doc,) = doc_examples("TelemetryMessage")
    sent = set().union(*(set(t) for t in real.on(real.topics.telemetry)))
    assert set(doc) <= sent, f"not sent by the device: {sorted(set(doc) - sent)}"
    section = DOC.read_text().split("### TelemetryMessage", 1)[1].split("```json", 1)[0]
    assert "excerpt" in section, "a partial telemetry example must say it is one"


def test_result_example_is_what_the_device_sends(real: RealDevice) -> None:
    (doc,) = doc_examples("ResultMessage")
    _one_matches(doc, real.on(real.topics.results("cam0")), "ResultMessage")


def test_job_status_examples_are_what_the_device_sends(real: RealDevice) -> None:
    docs = doc_examples("JobStatus")
    jobs = real.jobs()
    for doc in docs:
        same_state = [j for j in jobs if j["state"] == doc["state"]]
        _one_matches(doc, same_state, f"JobStatus {doc['state']}")
    # What an integrator must see once: a failure, with its code and text.
    assert any("error_code" in doc and "error" in doc for doc in docs)
    assert any("requested" in doc and "effective" in doc for doc in docs)


def test_command_examples_are_what_the_operator_and_device_send(real: RealDevice) -> None:
    (request,) = doc_examples("CommandRequest")
    _one_matches(request, real.on(real.topics.cmd("rollback")), "CommandRequest")
    replies = real.on(real.topics.cmd_reply("rollback"))
    docs = doc_examples("CommandReply")
    for doc in docs:
        _one_matches(doc, replies, f"CommandReply ok={doc['ok']}")
    assert {doc["ok"] for doc in docs} == {True, False}


def test_manifest_examples_name_every_key_fleet_deploy_sends(real: RealDevice) -> None:
    (signed,) = doc_examples("SignedManifest")
    (manifest,) = doc_examples("DeployManifest")
    sent = [m for m in real.on(real.topics.desired("main")) if "doc-refused" not in m["manifest"]]
    assert sent, "fleet deploy published no manifest"
    assert set(signed) == set(sent[0])
    body = json.loads(sent[0]["manifest"])
    # Optional keys (device, build, pre/postprocess) are all shown: the doc's keys are a superset.
    assert set(body) <= set(manifest), f"not in the doc: {sorted(set(body) - set(manifest))}"
    assert set(body["build"]) <= set(manifest["build"])


def _documented_result(command: str) -> set[str]:
    """The ``{a, b, ...}`` result keys the Commands table of docs/protocol.md gives ``command``."""
    row = re.search(rf"^\| `{command}` \|.*$", DOC.read_text(), re.M)
    assert row, f"docs/protocol.md's Commands table has no row for {command}"
    keys = re.search(r"result `\{([^}]*)\}`", row.group(0))
    assert keys, f"the {command} row names no result `{{...}}`"
    return {k.strip() for k in keys.group(1).split(",")}


def test_command_results_are_the_documented_keys(real: RealDevice) -> None:
    for command in ("status", "rollback"):
        results = [r["result"] for r in real.on(real.topics.cmd_reply(command)) if r["ok"]]
        assert results, f"no successful {command} reply"
        assert set(results[0]) == _documented_result(command), command


def test_a_refused_job_id_gets_one_terminal_state(real: RealDevice) -> None:
    """docs/protocol.md, JobStatus: one terminal state per job id, the REJECTED of a refusal included."""
    refused = [j for j in real.jobs() if j["job_id"] == "doc-refused"]
    assert [(j["state"], j["error_code"]) for j in refused] == [("REJECTED", "wrong_device")]
