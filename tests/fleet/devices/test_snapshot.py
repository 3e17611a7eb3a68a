"""``fleet snapshot`` and ``fleet evidence`` refuse a reply that is not a JPEG, naming its code.

The device is a plain paho client (tests/mqtt_probe.py) whose replies carry, as ``jpeg_base64``,
base64 of a PNG: valid base64 in valid JSON, not a JPEG.
"""

from __future__ import annotations

import base64
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from agent.cli import main
from agent.demo.broker import Broker
from agent.protocol.messages import CommandReply, encode
from agent.protocol.topics import Topics
from tests.fleet.operator_side import announce, unique_prefix
from tests.mqtt_probe import Probe
from tests.waiting import patient

#: A PNG's first bytes: what the device sends instead of a JPEG.
NOT_A_JPEG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(64)).decode("ascii")


def _answer(probe: Probe, topics: Topics, name: str, results: list[dict[str, Any]]) -> threading.Thread:
    """The device: the n-th request of command ``name`` answered ``ok`` with ``results[n]``."""

    def run() -> None:
        for n, result in enumerate(results):
            request = probe.wait_for_count(topics.cmd(name), n + 1, timeout=30)[n]
            reply = CommandReply(command=name, ok=True, result=result)
            probe.publish(
                request.response_topic or "", encode(reply), correlation_data=request.correlation_data
            )

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_a_snapshot_that_is_not_a_jpeg_is_refused_with_its_code_and_not_written(
    as_json: bool, tmp_path: Path, broker: Broker, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = unique_prefix()
    topics = Topics(prefix, "jet-01")
    result = {"stream": "cam", "frame_index": 7, "width": 8, "height": 8, "jpeg_base64": NOT_A_JPEG}
    output = tmp_path / "frame.jpg"
    with Probe(broker.host, broker.port) as probe:
        announce(probe, prefix, "jet-01")
        probe.subscribe(topics.cmd("snapshot"))
        thread = _answer(probe, topics, "snapshot", [result])
        argv = ["fleet", "snapshot", "jet-01", "-o", str(output), *(["--json"] if as_json else [])]
        code = main([*argv, "--broker", f"{broker.host}:{broker.port}", "--prefix", prefix])
        thread.join(patient(10))
    shown = capsys.readouterr()
    assert code == 1
    message = "the device's snapshot is not a JPEG (no SOI marker) (bad_snapshot)"
    assert shown.err.splitlines() == [f"error: {message}"]
    if as_json:
        assert json.loads(shown.out) == {"ok": False, "error_code": "bad_snapshot", "error": message}
    else:
        assert shown.out == ""
    assert not output.exists()


def test_an_evidence_frame_that_is_not_a_jpeg_is_refused_with_its_code_and_nothing_written(
    tmp_path: Path, broker: Broker, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = unique_prefix()
    topics = Topics(prefix, "jet-01")
    index = {"job_id": "job-8", "slot": "main", "reason": "disagreement", "frames": [{"frame": 0}]}
    frame = {"frame": 0, "agreement": 0.2, "serving": {}, "candidate": {}, "jpeg_base64": NOT_A_JPEG}
    output = tmp_path / "evidence"
    with Probe(broker.host, broker.port) as probe:
        announce(probe, prefix, "jet-01")
        probe.subscribe(topics.cmd("evidence"))
        thread = _answer(probe, topics, "evidence", [index, frame])
        argv = ["fleet", "evidence", "jet-01", "job-8", "-o", str(output)]
        code = main([*argv, "--broker", f"{broker.host}:{broker.port}", "--prefix", prefix])
        thread.join(patient(10))
    shown = capsys.readouterr()
    assert code == 1
    assert shown.err.splitlines() == [
        "error: the device's evidence frame is not a JPEG (no SOI marker) (bad_evidence)"
    ]
    assert shown.out == ""
    assert not output.exists()
