"""docs/protocol.md shows a valid example of every message and spells every topic of the tree."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from agent.machine.jetson_files import jetpack_for_l4t, parse_tegra_release
from agent.machine.platform import BackendAvailability, Platform, platform_summary
from agent.protocol.messages import MESSAGE_MODELS, CommandReply, decode, encode
from agent.protocol.topics import Topics
from tests.protocol.examples import EXAMPLES, MORE_EXAMPLES

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def _examples_under_heading(text: str, name: str) -> list[str]:
    match = re.search(rf"^### {name}\n(.*?)(?=^#)", text + "\n#", re.S | re.M)
    assert match, f"docs/protocol.md has no '### {name}' section"
    blocks = re.findall(r"```json\n(.*?)```", match.group(1), re.S)
    assert blocks, f"docs/protocol.md's '### {name}' has no ```json example"
    return blocks


@pytest.mark.parametrize("model", MESSAGE_MODELS, ids=lambda m: m.__name__)
def test_doc_examples_are_valid_and_current(model: type[BaseModel]) -> None:
    text = DOC.read_text()
    examples = _examples_under_heading(text, model.__name__)
    expected = [EXAMPLES[model.__name__], *MORE_EXAMPLES.get(model.__name__, [])]
    assert len(examples) == len(expected), "one entry in tests/protocol/examples.py per doc example"
    for example, wanted in zip(examples, expected, strict=True):
        parsed = decode(model, example.encode())
        # Current: the doc shows what the model encodes today (regenerate from tests/protocol/examples.py;
        # tests/e2e/test_protocol_doc_examples.py checks the keys against a real device's messages).
        assert json.loads(example) == json.loads(encode(wanted))
        assert parsed == wanted


def test_every_message_has_an_example() -> None:
    assert set(EXAMPLES) == {m.__name__ for m in MESSAGE_MODELS}


def test_doc_spells_every_topic_of_the_tree() -> None:
    text = DOC.read_text()
    t = Topics("{p}", "{dev}")
    topics = [
        t.status, t.info, t.telemetry, t.samples, t.xfer_req, t.results("{stream}"), t.jobs("{job_id}"),
        t.cmd_reply("{name}"), t.desired("{slot}"), t.xfer("{sha256}"), t.cmd("{name}"),
    ]  # fmt: skip
    for topic in topics:
        assert f"`{topic}`" in text, topic
    assert "pattern write fleet/v1/%u/up/#" in text


def test_info_example_platform_has_the_keys_platform_summary_gives_a_jetson() -> None:
    """The fast half of tests/e2e/test_protocol_doc_examples.py's check, for a Jetson that read everything."""
    (example,) = _examples_under_heading(DOC.read_text(), "InfoMessage")
    jetson = Platform(
        is_jetson=True, machine="aarch64", l4t_release="R36.4.0", jetpack="6.1", device_model="Orin",
        cuda_driver="12.6", cuda_runtime="12.6", gpu_name="Orin", compute_capability="8.7", dla_cores=2,
        tensorrt_version="10.3.0", onnxruntime_version="1.20.0", ort_providers=("CPUExecutionProvider",),
        backends={name: BackendAvailability(True, name) for name in ("tensorrt", "onnxruntime")},
    )  # fmt: skip
    assert set(json.loads(example)["platform"]) == set(platform_summary(jetson))


def test_info_example_l4t_release_and_jetpack_are_what_a_jetson_reads() -> None:
    """The example's release is spelled as the device reads /etc/nv_tegra_release, and its JetPack
    is the one that release maps to."""
    (example,) = _examples_under_heading(DOC.read_text(), "InfoMessage")
    platform = json.loads(example)["platform"]
    read = parse_tegra_release(
        "# R36 (release), REVISION: 4.0, GCID: 37537400, BOARD: generic, EABI: aarch64"
    )
    assert platform["l4t_release"] == read == "R36.4.0"
    assert platform["jetpack"] == jetpack_for_l4t(read)


def test_the_null_rule_is_what_encode_does() -> None:
    """A message's null fields are left out; a ``CommandReply``'s ``result`` keeps its nulls (the
    controller's RolloutStatus, whose building devices carry null frames when none were sent)."""
    transport = DOC.read_text().split("Transport: MQTT 5", 1)[1].split("\n## ", 1)[0]
    assert "fields that are `null` are left out" in transport
    assert "`CommandReply`'s `result`" in transport
    building = {"device": "jet-02", "phase": "building", "frames_done": None, "estimate_s": None}
    reply = json.loads(encode(CommandReply(command="status", ok=True, result={"building": [building]})))
    assert not {"error", "error_code"} & set(reply)  # null fields: left out
    assert reply["result"]["building"] == [building]  # the answer's nulls: kept
