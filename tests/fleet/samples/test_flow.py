"""Samples end to end through a real mosquitto: a device's sampler (on its real frame board, as the
agent wires it) publishes on up/samples with a real MqttLink, the real controller keeps them in its
bounded store (files under its state_dir, or its real PostgreSQL), and the export is read back (COCO
JSON parsed, every image decodes, boxes present; class folders of JPEGs). A malformed sample is
counted and dropped, costing the store nothing. On PostgreSQL, a controller on another state_dir
takes the samples over and the CLI exports the same dataset from there."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import cv2
import numpy as np
import paho.mqtt.publish as mqtt_publish
import psycopg
import pytest

from agent.cli import main
from agent.config.models import SamplesConfig
from agent.demo.broker import Broker
from agent.fleet.controller.config import ControllerConfig
from agent.fleet.controller.process import FleetController
from agent.fleet.samples.export import FORMATS, export_samples
from agent.fleet.samples.pg_store import PostgresSampleStore
from agent.fleet.samples.store import FileSampleStore, SampleBounds
from agent.fleet.statedb.settings import DatabaseSettings
from agent.mqtt.link import MqttLink
from agent.protocol.results import ClassScore, Detection, Prediction
from agent.protocol.samples import SampleMessage
from agent.protocol.topics import Topics
from agent.runtime.frames.samples import SamplePublisher, Sampler
from agent.runtime.frames.snapshots import SnapshotBoard
from agent.spool.queue import Spool
from tests.fleet.operator_side import operator_settings, unique_prefix
from tests.postgres_server import PostgresServer
from tests.sample_results import result
from tests.test_cli import agent_cli
from tests.waiting import patient, wait_until


@pytest.fixture
def prefix() -> str:
    return unique_prefix()


@pytest.fixture(params=["files", "postgresql"])
def database(request: pytest.FixtureRequest) -> DatabaseSettings:
    """The controller's store: SQLite and files under its state_dir, or a fresh PostgreSQL database."""
    if request.param == "files":
        return DatabaseSettings()
    server: PostgresServer = request.getfixturevalue("postgres")
    return _on(server, server.new_database())


def _on(server: PostgresServer, name: str) -> DatabaseSettings:
    return DatabaseSettings(url=server.url(name), password_file=server.password_file)


def _started(config: ControllerConfig) -> tuple[FleetController, threading.Event, threading.Thread]:
    controller = FleetController(config).start()
    stop = threading.Event()
    thread = threading.Thread(target=controller.run, args=(stop,), daemon=True)
    thread.start()
    return controller, stop, thread


def _stopped(controller: FleetController, stop: threading.Event, thread: threading.Thread) -> None:
    stop.set()
    thread.join(patient(10))
    controller.stop()


def _config(broker: Broker, prefix: str, state_dir: Path, database: DatabaseSettings) -> ControllerConfig:
    return ControllerConfig(
        mqtt=operator_settings(broker, prefix),
        state_dir=state_dir,
        unsigned=True,
        samples=SampleBounds(per_device=3),
        database=database,
    )


@pytest.fixture
def controller(
    tmp_path: Path, broker: Broker, prefix: str, database: DatabaseSettings
) -> Iterator[FleetController]:
    running = _started(_config(broker, prefix, tmp_path / "controller", database))
    yield running[0]
    _stopped(*running)


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
    # Where the controller keeps them: its state_dir, or only the database.
    on_disk = list((tmp_path / "controller" / "samples").glob("*.json"))
    assert len(on_disk) == (3 if isinstance(store, FileSampleStore) else 0)
    assert isinstance(store, PostgresSampleStore) == (controller.config.database.url is not None)


def test_the_cli_exports_from_the_controllers_state_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state_dir = tmp_path / "controller"
    store = FileSampleStore(state_dir / "samples")
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


def test_the_cli_exports_from_the_state_dir_its_controller_config_names(
    tmp_path: Path, broker: Broker, capsys: pytest.CaptureFixture[str]
) -> None:
    state_dir = tmp_path / "controller"
    config = tmp_path / "controller.yaml"
    config.write_text(
        json.dumps(
            {
                "mqtt": {"host": broker.host, "port": broker.port},
                "state_dir": str(state_dir),
                "unsigned": True,
            }
        )
    )
    argv = ["fleet", "samples", "export", "--format", "folders", "-c", str(config), "-o", str(tmp_path / "o")]
    assert main(argv) == 1
    assert f"-c {config}: no samples/ in its state_dir {state_dir}" in capsys.readouterr().err
    FileSampleStore(state_dir / "samples").add(
        "cam-1", _sample(Prediction(classes=[ClassScore(index=0, label="cat", score=0.2)]))
    )
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["images"] == 1
    assert len(list((tmp_path / "o" / "cat").glob("*.jpg"))) == 1
    with pytest.raises(SystemExit):
        main([*argv, "--state-dir", str(state_dir)])
    assert "not allowed with argument" in capsys.readouterr().err


def test_the_cli_names_a_database_no_controller_has_made_the_tables_of(
    tmp_path: Path, broker: Broker, prefix: str, postgres: PostgresServer
) -> None:
    name = postgres.new_database()
    config = _controller_yaml(tmp_path / "c.yaml", broker, prefix, tmp_path / "host", _on(postgres, name))
    exported = agent_cli(
        "fleet", "samples", "export", "--format", "coco", "-c", str(config), "-o", str(tmp_path / "o")
    )
    assert exported.returncode == 1
    assert f"/{name} has no samples table yet" in exported.stderr
    assert "Traceback" not in exported.stderr
    with psycopg.connect(postgres.conninfo(name)) as pg:  # the export made nothing
        assert pg.execute("SELECT to_regclass('schema_migrations')").fetchone() == (None,)


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


def _dataset(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _controller_yaml(
    path: Path, broker: Broker, prefix: str, state_dir: Path, database: DatabaseSettings
) -> Path:
    config = {
        "mqtt": {"host": broker.host, "port": broker.port, "prefix": prefix},
        "state_dir": str(state_dir),
        "unsigned": True,
        "database": {"url": database.url, "password_file": str(database.password_file)},
    }
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def test_a_controller_on_another_state_dir_takes_over_the_samples_and_the_cli_exports_them_alike(
    tmp_path: Path, broker: Broker, prefix: str, postgres: PostgresServer
) -> None:
    """Two controller hosts with no shared disk, one PostgreSQL: what host A kept, host B (another
    state_dir, after A stopped) lists, bounds and exports byte for byte as A did; the CLI in a process
    of its own, given B's config, writes the same dataset."""
    database = _on(postgres, postgres.new_database())
    boxes = Prediction(detections=[Detection(index=0, label="dog", score=0.3, box=(1, 2, 30, 40))])
    cat = Prediction(classes=[ClassScore(index=0, label="cat", score=0.2)])
    sent = [("cam-1", _sample(boxes)), ("cam-1", _sample(cat)), ("cam-2", _sample(boxes))]
    first = _started(_config(broker, prefix, tmp_path / "host-a", database))
    store_a = first[0].samples
    assert isinstance(store_a, PostgresSampleStore)
    for device, sample in sent:
        mqtt_publish.single(
            Topics(prefix, device).samples,
            sample.model_dump_json(),
            qos=1,
            hostname=broker.host,
            port=broker.port,
        )
    wait_until(lambda: len(store_a.samples()) == 3, what="three samples in host A's store")
    kept = store_a.samples()
    for fmt in FORMATS:
        export_samples(store_a, fmt, tmp_path / f"a-{fmt}")
    _stopped(*first)

    second = _started(_config(broker, prefix, tmp_path / "host-b", database))
    try:
        store_b = second[0].samples
        assert store_b is not None
        assert store_b.samples() == kept
        for fmt in FORMATS:
            export_samples(store_b, fmt, tmp_path / f"b-{fmt}")
            assert _dataset(tmp_path / f"b-{fmt}") == _dataset(tmp_path / f"a-{fmt}") != {}
        config_b = _controller_yaml(tmp_path / "b.yaml", broker, prefix, tmp_path / "host-b", database)
        out = tmp_path / "cli-coco"
        exported = agent_cli(
            "fleet", "samples", "export", "--format", "coco", "-c", str(config_b), "-o", str(out)
        )
        assert exported.returncode == 0, exported.stderr
        assert json.loads(exported.stdout)["images"] == 2
        assert _dataset(out) == _dataset(tmp_path / "a-coco")
        assert not (tmp_path / "host-b" / "samples").exists() or not any(
            (tmp_path / "host-b" / "samples").iterdir()
        )
        # Host B keeps adding within the same bounds: cam-1's fourth sample evicts its oldest.
        for _ in range(2):
            assert store_b.add("cam-1", _sample(cat)) is not None
        assert [s.device for s in store_b.samples()].count("cam-1") == 3
        assert kept[0] not in store_b.samples()
    finally:
        _stopped(*second)
