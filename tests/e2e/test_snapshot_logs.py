"""End to end: ``fleet snapshot`` and ``fleet logs`` against the real daemon on a real video.

The snapshot's pixels are compared with the video's own frame at the index the device names (and
shown to differ from its neighbours, so the comparison could fail), and its result with the result
message the device published for that frame; the same through ``fleet snapshot`` and through a
real controller's console (its HTTP server, its token file). A flood of requests meets the device's
rate limit.
"""

from __future__ import annotations

import base64
import io
import json
import secrets
import threading
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import numpy.typing as npt
import pytest

from agent.cli import main
from agent.demo.broker import Broker, free_port
from agent.demo.setup import write_demo_video
from agent.fleet.controller.config import ControllerConfig, HttpSettings
from agent.fleet.controller.process import FleetController
from agent.fleet.devices.command import DeviceRefusedError, DeviceSession, PendingReplies, publish_command
from agent.fleet.devices.logs import print_logs
from agent.fleet.devices.snapshot import save_snapshot, take_snapshot
from agent.mqtt.service_client import ServiceClient
from agent.mqtt.settings import MqttSettings
from agent.protocol.topics import Topics
from tests.e2e.daemon import AgentFiles, Daemon, unique_results
from tests.mqtt_probe import Probe
from tests.waiting import patient, wait_until

pytestmark = pytest.mark.slow

PER_MINUTE = 6
PROTOCOL_DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def _documented(after: str) -> dict[str, Any]:
    """The JSON example that follows the sentence ``after`` in docs/protocol.md."""
    text = PROTOCOL_DOC.read_text()
    start = text.index("```json", text.index(after)) + len("```json")
    return dict(json.loads(text[start : text.index("```", start)]))


def _keys(value: Any) -> Any:
    """The key structure of ``value``: nested dicts' keys, a list by its first element."""
    if isinstance(value, dict):
        return {key: _keys(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_keys(value[0])] if value else []
    return None


def _post(url: str, token: str | None = None) -> tuple[int, dict[str, Any]]:
    """POST ``url`` (a real HTTP server); the status and the JSON answer, error statuses too."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(url, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=patient(30)) as response:
            return response.status, dict(json.loads(response.read()))
    except urllib.error.HTTPError as exc:
        return exc.code, dict(json.loads(exc.read()))


def _video_frames(path: Path) -> list[npt.NDArray[Any]]:
    capture = cv2.VideoCapture(str(path))
    frames: list[npt.NDArray[Any]] = []
    while True:
        ok, image = capture.read()
        if not ok:
            break
        frames.append(image)
    capture.release()
    return frames


def _pixels(jpeg: bytes) -> npt.NDArray[Any]:
    image = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)
    assert image is not None, "not a JPEG"
    return image


def _diff(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> float:
    return float(np.abs(a.astype(np.float32) - b.astype(np.float32)).mean())


def test_snapshot_is_the_frame_of_its_result_and_is_rate_limited(
    tmp_path: Path, broker: Broker, device_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # A prefix of its own: the real controller below takes the prefix's lease.
    prefix = f"t{uuid.uuid4().hex[:8]}/v1"
    files = AgentFiles(tmp_path, broker.port, device_id, frames=40)
    config = files.write_config(snapshot={"per_minute": PER_MINUTE}, mqtt={"prefix": prefix})
    settings = MqttSettings(host=broker.host, port=broker.port, prefix=prefix)
    token = secrets.token_urlsafe(16)
    token_file = tmp_path / "console.token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    controller = FleetController(
        ControllerConfig(
            mqtt=settings,
            state_dir=tmp_path / "controller",
            unsigned=True,
            http=HttpSettings(port=free_port(), token_file=token_file),
        )
    ).start()
    probe = Probe(broker.host, broker.port)
    probe.subscribe(f"{prefix}/{device_id}/up/#")
    daemon = Daemon(config, tmp_path / "agent.log")
    topic = f"{prefix}/{device_id}/up/results/cam"
    try:
        # Play-once file: once every result is out, the latest snapshot is fixed, so the test
        # compares against a frame that cannot move on underneath it.
        probe.wait_for(lambda ms: len(unique_results(ms, topic)) >= files.frames, timeout=60)
        full = take_snapshot(settings, device_id, stream="cam")
        small = take_snapshot(settings, device_id, max_dimension=64)

        # The console's button on the real controller: its token, then the device through the broker.
        wait_until(lambda: controller.view.device(device_id) is not None, 30, "the device in the view")
        route = f"{controller.http.url}/api/devices/{device_id}/snapshot"
        no_token = _post(route)
        shown = _post(route + "?stream=cam", token)
        unknown = _post(f"{controller.http.url}/api/devices/nobody/snapshot", token)
        # The CLI, as docs/fleet.md shows it.
        cli_file = tmp_path / "cli.jpg"
        broker_at = f"{broker.host}:{broker.port}"
        argv = [
            "fleet",
            "snapshot",
            device_id,
            "-o",
            str(cli_file),
            "--broker",
            broker_at,
            "--prefix",
            prefix,
        ]
        assert main(argv) == 0
        # Its one line comes last (the controller in this process logged to the same stdout before).
        printed = capsys.readouterr().out.strip().splitlines()[-1]

        # A flood: every request published before any reply is read.
        pending = PendingReplies()
        client = ServiceClient(settings, handler=pending.offer)
        client.start()
        topics = Topics(settings.prefix, device_id)
        try:
            client.subscribe(topics.cmd_reply("snapshot"))
            correlations = [pending.expect() for _ in range(10)]
            for correlation in correlations:
                publish_command(client, topics, "snapshot", {}, correlation)
            replies = [pending.wait(c, 20.0) for c in correlations]
        finally:
            client.stop()
        with pytest.raises(DeviceRefusedError) as wrong:
            take_snapshot(settings, device_id, stream="nope")
        limited = _post(route, token)
    finally:
        code = daemon.stop()
        probe.close()
        controller.stop()
    assert code == 0, daemon.log()[-2000:]

    frames = _video_frames(files.video)
    results = {r.frame_index: r for r in unique_results(probe.snapshot(), topic)}
    index = full.meta["frame_index"]
    assert index == files.frames - 1  # the last frame, whose result is the last one published
    image = _pixels(full.jpeg)
    assert image.shape == frames[index].shape == (120, 160, 3)
    assert (full.meta["width"], full.meta["height"]) == (160, 120)
    own = _diff(image, frames[index])
    assert own < 4.0  # JPEG at quality 85 of the same pixels
    assert own * 3 < min(_diff(image, frames[i]) for i in (index - 1, index - 3, index - 10))
    # The result is the one published for that very frame (its labels, its model, its timestamps).
    assert full.meta["result"] == results[index].model_dump(mode="json", exclude_none=True)
    labels = [c["label"] for c in full.meta["result"]["classes"]]
    assert labels
    assert labels == [c.label for c in results[index].classes or []]

    # Downscaled to the asked bound, same frame.
    assert (small.meta["width"], small.meta["height"]) == (64, 48)
    tiny = _pixels(small.jpeg)
    expected = cv2.resize(frames[small.meta["frame_index"]], (64, 48), interpolation=cv2.INTER_AREA)
    assert _diff(tiny, expected) < 6.0
    out = tmp_path / "snap.jpg"
    save_snapshot(full, out)
    assert out.read_bytes() == full.jpeg

    # The console's answer: the same frame and result, the JPEG as base64, only with the token.
    assert (no_token[0], shown[0], unknown[0]) == (401, 200, 404)
    through_console = shown[1]["snapshot"]
    assert through_console["frame_index"] == index
    assert through_console["result"] == full.meta["result"]
    jpeg = base64.b64decode(through_console["jpeg_base64"])
    assert _diff(_pixels(jpeg), frames[index]) < 4.0

    # The CLI wrote the same frame and printed what docs/fleet.md shows; the documented reply has
    # the keys of the real one.
    assert cli_file.read_bytes().startswith(b"\xff\xd8")
    labels_line = ", ".join(f"{c['label']} {c['score']:.2f}" for c in full.meta["result"]["classes"])
    assert (
        printed.strip()
        == f"{cli_file}: stream cam frame {index}, 160x120, {full.meta['bytes']} bytes; {labels_line}"
    )
    real = {**full.meta, "jpeg_base64": ""}
    assert _keys(_documented("A `snapshot` reply's `result`")) == _keys(real)

    # PER_MINUTE in a minute: four were taken above, so two of the flood pass, eight are refused.
    assert all(r is not None for r in replies)
    codes = [r.error_code if r is not None and not r.ok else "ok" for r in replies]
    assert codes.count("ok") == PER_MINUTE - 4
    assert codes.count("rate_limited") == 10 - (PER_MINUTE - 4)
    assert limited[0] == 429
    assert "snapshot.per_minute" in limited[1]["error"]
    refused = next(r for r in replies if r is not None and r.error_code == "rate_limited")
    assert "snapshot.per_minute" in (refused.error or "")
    # A wrong stream is refused before the rate is counted.
    assert wrong.value.code == "wrong_stream"


def test_logs_last_lines_capped_and_followed_without_duplicates(
    tmp_path: Path, broker: Broker, device_id: str, probe: Probe, capsys: pytest.CaptureFixture[str]
) -> None:
    files = AgentFiles(tmp_path, broker.port, device_id, frames=20)
    daemon = Daemon(files.write_config(), tmp_path / "agent.log")
    settings = MqttSettings(host=broker.host, port=broker.port)
    try:
        probe.wait_for_count(f"fleet/v1/{device_id}/up/info", 1, timeout=60)
        daemon.wait_for_event("agent.started", timeout=60)
        last = io.StringIO()
        assert print_logs(settings, device_id, 3, last, io.StringIO()) == 0
        assert main(["fleet", "logs", device_id, "-n", "2", "--broker", f"{broker.host}:{broker.port}"]) == 0
        cli_lines = capsys.readouterr().out.splitlines()
        with DeviceSession(settings, device_id, "logs") as session:
            too_many = session.ask({"lines": 5000})
            everything = session.ask({"lines": 1000})

        out, err = io.StringIO(), io.StringIO()
        stop = threading.Event()
        follower = threading.Thread(
            target=print_logs,
            args=(settings, device_id, 5, out, err),
            kwargs={"follow": True, "stop": stop, "interval_s": 0.05},
        )
        polls = f"fleet/v1/{device_id}/down/cmd/logs"
        probe.subscribe(polls)
        follower.start()
        try:
            # The follower's own polls add nothing to what it follows: 20 of them, then other commands.
            probe.wait_for_count(polls, 20, timeout=60)
            # Each other command the device serves logs a line: new lines appear while the follower polls.
            with DeviceSession(settings, device_id, "status") as status:
                for _ in range(5):
                    assert status.ask({}).ok
            wait_until(lambda: out.getvalue().count('"command": "status"') >= 5, 30, "5 status lines")
        finally:
            stop.set()
            follower.join(patient(30))
    finally:
        assert daemon.stop() == 0, daemon.log()[-2000:]

    assert len(last.getvalue().splitlines()) == 3
    assert len(cli_lines) == 2
    assert all(line.startswith("{") for line in cli_lines)  # the device's JSON lines, as rendered
    assert not too_many.ok
    assert too_many.error_code == "bad_args"
    assert "lines" in (too_many.error or "")
    result = everything.result or {}
    seqs = [line["seq"] for line in result["lines"]]
    assert seqs == sorted(seqs)
    assert len(seqs) == len(set(seqs))
    assert any('"event": "agent.started"' in line["line"] for line in result["lines"])
    assert _keys(_documented("A `logs` reply's `result`")) == _keys(result)
    followed = out.getvalue().splitlines()
    assert len(followed) == len(set(followed))  # timestamps make every line unique: none twice
    assert sum('"command": "status"' in line for line in followed) == 5
    assert not [line for line in followed if '"command": "logs"' in line]
    assert len(probe.on_topic(polls)) >= 20
    assert "missed" not in err.getvalue()


def test_a_big_frame_in_a_tiny_byte_budget(
    tmp_path: Path, broker: Broker, device_id: str, probe: Probe
) -> None:
    files = AgentFiles(tmp_path, broker.port, device_id, frames=10)
    big = write_demo_video(tmp_path / "big.avi", frames=10, size=(1920, 1080), fps=30.0)
    stream = {"source": {"type": "file", "path": str(big), "loop": False, "realtime": True}}
    config = files.write_config(stream=stream, snapshot={"max_bytes": 1024})
    daemon = Daemon(config, tmp_path / "agent.log")
    settings = MqttSettings(host=broker.host, port=broker.port)
    topic = f"fleet/v1/{device_id}/up/results/cam"
    try:
        probe.wait_for(lambda ms: len(unique_results(ms, topic)) >= 10, timeout=60)
        snap = take_snapshot(settings, device_id)
    finally:
        assert daemon.stop() == 0, daemon.log()[-2000:]

    meta = snap.meta
    assert (meta["source_width"], meta["source_height"]) == (1920, 1080)
    assert len(snap.jpeg) == meta["bytes"] <= 1024
    assert meta["width"] <= 640
    assert meta["width"] / meta["height"] == pytest.approx(1920 / 1080, rel=0.05)
    image = _pixels(snap.jpeg)
    frame = _video_frames(big)[meta["frame_index"]]
    expected = cv2.resize(frame, (meta["width"], meta["height"]), interpolation=cv2.INTER_AREA)
    assert _diff(image, expected) < 20.0  # low quality, but that frame
