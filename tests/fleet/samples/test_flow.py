"""Samples end to end through a real mosquitto: a device's sampler (on its real frame board, as the
agent wires it) publishes on up/samples with a real MqttLink, the real controller keeps them in its
bounded store, and the export is read back (COCO JSON parsed, every image decodes, boxes present;
class folders of JPEGs). A malformed sample is counted and dropped, costing the store nothing."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import cv2
import numpy as np
import paho.mqtt.publish as mqtt_publish
import pytest

from agent.cli import main
from agent.config.models import SamplesConfig
from agent.demo.broker import Broker
from agent.fleet.controller.config import ControllerConfig
from agent.fleet.controller.process import FleetController
from agent.fleet.samples.export import export_samples
from agent.fleet.samples.store import SampleBounds, SampleStore
from agent.mqtt.link import MqttLink
from agent.protocol.results import ClassScore, Detection, Prediction
from agent.protocol.samples import SampleMessage
from agent.protocol.topics import Topics
from agent.runtime.frames.samples import SamplePublisher, Sampler
from agent.runtime.frames.snapshots import SnapshotBoard
from agent.spool.queue import Spool
from tests.fleet.operator_side import operator_settings, unique_prefix
from tests.sample_results import result
from tests.waiting import patient, wait_until


@pytest.fixture
def prefix() -> str:
    return unique_prefix()


@pytest.fixture
def controller(tmp_path: Path, broker: Broker, prefix: str) -> Iterator[FleetController]:
    config = ControllerConfig(
        mqtt=operator_settings(broker, prefix),
        state_dir=tmp_path / "controller",
        unsigned=True,
        samples=SampleBounds(per_device=3),
    )
    controller = FleetController(config).start()
    stop = threading.Event()
    thread = threading.Thread(target=controller.run, args=(stop,), daemon=True)
    thread.start()
    yield controller
    stop.set()
    thread.join(patient(10))
    controller.stop()


def _device(tmp_path: Path, broker: Broker, prefix: str, device: str) -> tuple[MqttLink, Topics]:
    topics = Topics(prefix, device)
    link = MqttLink(
        operator_settings(broker, prefix),
        client_id=device,
        status_topic=topics.status,
        agent_version="0.0.test",
        spool=Spool(tmp_path / f"{device}.sqlite"),
    )
    link.start()
    wait_until(lambda: link.connected, what="the device link to connect")
    return link, topics


def _frame(seed: int) -> np.ndarray:
    image = np.full((240, 320, 3), 40, np.uint8)
    cv2.rectangle(image, (32 + seed, 24), (96 + seed, 120), (0, 200, 255), -1)
    return image


def test_samples_flow_from_a_device_to_the_controller_and_export_as_a_dataset(
    tmp_path: Path, broker: Broker, prefix: str, controller: FleetController
) -> None:
    link, topics = _device(tmp_path, broker, prefix, "cam-1")
    stop = threading.Event()
    try:
        detector = Sampler(SamplesConfig(enabled=True, per_minute=10), "det")
        classifier = Sampler(SamplesConfig(enabled=True, per_minute=10), "cls")
        publisher = SamplePublisher(
            [detector, classifier],
            lambda message: link.publish(topics.samples, message, qos=1),
            lambda: link.payload_limit(topics.samples),
            stop,
        )
        publisher.start()
        boards = {"det": SnapshotBoard(), "cls": SnapshotBoard()}
        boards["det"].on_paired = detector.offer
        boards["cls"].on_paired = classifier.offer
        sure = Prediction(detections=[Detection(index=0, label="person", score=0.95, box=(32, 24, 96, 120))])
        unsure = Prediction(
            detections=[
                Detection(index=0, label="person", score=0.35, box=(32, 24, 96, 120)),
                Detection(index=4, label="bag", score=0.9, box=(150, 100, 200, 180)),
            ]
        )
        low_class = Prediction(classes=[ClassScore(index=2, label="forklift", score=0.3)])
        # What the pipeline does per frame: inferred (the image), then published (its result).
        for frame, (slot, prediction) in enumerate(
            [("det", sure), ("det", unsure), ("cls", low_class), ("det", unsure), ("det", sure)]
        ):
            boards[slot].inferred("cam", frame, _frame(frame))
            boards[slot].published(result(prediction, frame, slot=slot))
        assert controller.samples is not None
        store = controller.samples
        wait_until(lambda: len(store.samples()) == 3, what="three samples in the controller's store")
        assert publisher.published == 3
        assert publisher.stats()["dropped"] == 0
    finally:
        stop.set()
        link.stop(timeout=5)

    summary = export_samples(store, "coco", tmp_path / "coco")
    assert (summary.images, summary.annotations, summary.skipped) == (2, 4, 1)
    coco = json.loads((tmp_path / "coco" / "annotations.json").read_text())
    assert {c["name"] for c in coco["categories"]} == {"person", "bag"}
    for image in coco["images"]:
        assert image["file_name"].startswith("images/cam-1-det-")
        pixels = cv2.imread(str(tmp_path / "coco" / image["file_name"]))
        assert pixels is not None
        assert pixels.shape[:2] == (image["height"], image["width"])
        boxes = [a for a in coco["annotations"] if a["image_id"] == image["id"]]
        assert sorted(a["score"] for a in boxes) == [0.35, 0.9]
    folders = export_samples(store, "folders", tmp_path / "folders")
    assert folders.images == 1
    (jpeg,) = (tmp_path / "folders" / "forklift").glob("*.jpg")
    assert cv2.imread(str(jpeg)) is not None


def test_the_cli_exports_from_the_controllers_state_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state_dir = tmp_path / "controller"
    store = SampleStore(state_dir / "samples")
    store.add("cam-1", _sample(Prediction(classes=[ClassScore(index=0, label="cat", score=0.2)])))
    store.add(
        "cam-2",
        _sample(Prediction(detections=[Detection(index=0, label="dog", score=0.3, box=(1, 2, 30, 40))])),
    )
    out = tmp_path / "dataset"
    argv = ["fleet", "samples", "export", "--state-dir", str(state_dir), "-o", str(out)]
    assert main([*argv, "--format", "coco"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == {"format": "coco", "out": str(out), "images": 1, "annotations": 1, "skipped": 1}
    coco = json.loads((out / "annotations.json").read_text())
    assert coco["categories"] == [{"id": 1, "name": "dog"}]
    assert cv2.imread(str(out / coco["images"][0]["file_name"])) is not None
    assert main([*argv, "--format", "folders"]) == 0
    assert len(list((out / "cat").glob("*.jpg"))) == 1


def test_the_cli_names_a_state_dir_without_samples(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "fleet",
            "samples",
            "export",
            "--format",
            "coco",
            "--state-dir",
            str(tmp_path),
            "-o",
            str(tmp_path / "o"),
        ]
    )
    assert code == 1
    assert f"--state-dir {tmp_path}: no samples/ there" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def _sample(prediction: Prediction) -> SampleMessage:
    sampler = Sampler(SamplesConfig(enabled=True), "s")
    assert sampler.offer(_frame(0), result(prediction))
    message = sampler.take(payload_limit=256 * 1024)
    assert message is not None
    return message


def test_a_malformed_sample_is_counted_and_kept_nowhere(
    broker: Broker, prefix: str, controller: FleetController
) -> None:
    topic = Topics(prefix, "rogue").samples
    mqtt_publish.single(
        topic, b'{"msg_id": "x", "jpeg_b64": 5}', qos=1, hostname=broker.host, port=broker.port
    )
    wait_until(lambda: controller.samples_rejected == 1, what="the malformed sample to be counted")
    assert controller.samples is not None
    assert controller.samples.samples() == []
