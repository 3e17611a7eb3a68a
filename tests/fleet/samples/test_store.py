"""The controller's sample store (bounds in count, bytes, per device; oldest evicted; survives a
restart) and the export a labelling tool reads (COCO JSON re-read, class folders of JPEGs)."""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np

from agent.config.models import SamplesConfig
from agent.fleet.samples.export import export_samples
from agent.fleet.samples.store import SampleBounds, SampleStore
from agent.protocol.results import ClassScore, Detection, Prediction
from agent.protocol.samples import SampleMessage
from agent.runtime.frames.samples import Sampler
from tests.sample_results import result


def _sample(prediction: Prediction, frame: int = 1, slot: str = "s") -> SampleMessage:
    rng = np.random.default_rng(frame)
    image = rng.integers(0, 255, size=(240, 320, 3), dtype=np.uint8)
    sampler = Sampler(SamplesConfig(enabled=True, max_dimension=160, max_bytes=16 * 1024), slot)
    assert sampler.offer(image, result(prediction, frame, slot=slot))
    message = sampler.take(payload_limit=256 * 1024)
    assert message is not None
    return message


def _low_class(label: str = "cat") -> Prediction:
    return Prediction(
        classes=[ClassScore(index=0, label=label, score=0.3), ClassScore(index=1, label="dog", score=0.2)]
    )


def _low_boxes() -> Prediction:
    return Prediction(
        detections=[
            Detection(index=0, label="person", score=0.4, box=(32, 24, 96, 120)),
            Detection(index=2, label="car", score=0.9, box=(100, 100, 300, 200)),
        ]
    )


def test_one_device_cannot_fill_the_store(tmp_path: Path) -> None:
    store = SampleStore(tmp_path, SampleBounds(max_count=10, max_bytes=10**9, per_device=3))
    other = store.add("quiet", _sample(_low_class(), 100))
    assert other is not None
    for frame in range(6):
        store.add("loud", _sample(_low_class(), frame))
    kept = store.samples()
    assert [s.device for s in kept].count("loud") == 3
    assert other in kept
    assert [_read_frame(s.path) for s in kept if s.device == "loud"] == [3, 4, 5]  # the oldest went
    assert store.evicted == 3
    assert len(list(tmp_path.glob("*.json"))) == 4


def test_count_and_bytes_bounds_evict_the_oldest_and_a_restart_reads_back(tmp_path: Path) -> None:
    store = SampleStore(tmp_path, SampleBounds(max_count=3, max_bytes=10**9, per_device=100))
    for frame in range(5):
        store.add(f"d{frame}", _sample(_low_class(), frame))
    assert [s.device for s in store.samples()] == ["d2", "d3", "d4"]
    size = store.samples()[0].size
    # Below the configurable 1 MiB floor, so built unchecked: room for two and a half samples.
    bounds = SampleBounds.model_construct(max_count=100, max_bytes=size * 2 + size // 2, per_device=100)
    tight = SampleStore(tmp_path, bounds)
    assert [s.device for s in tight.samples()] == ["d2", "d3", "d4"]  # read back from disk
    tight.add("d5", _sample(_low_class(), 5))
    assert [s.device for s in tight.samples()] == ["d4", "d5"]
    assert tight.held_bytes() <= tight.bounds.max_bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(s.path.name for s in tight.samples())


def test_coco_export_is_read_back_with_boxes_in_the_jpegs_pixels(tmp_path: Path) -> None:
    store = SampleStore(tmp_path / "store")
    store.add("dev-a", _sample(_low_boxes(), 1, slot="det"))
    store.add("dev-b", _sample(_low_boxes(), 2, slot="det"))
    store.add("dev-b", _sample(_low_class(), 3, slot="cls"))  # a classifier's: not COCO
    summary = export_samples(store, "coco", tmp_path / "out")
    assert (summary.images, summary.annotations, summary.skipped) == (2, 4, 1)
    coco = json.loads((tmp_path / "out" / "annotations.json").read_text())
    assert {c["name"]: c["id"] for c in coco["categories"]} == {"person": 1, "car": 3}
    assert len(coco["images"]) == 2
    assert len(coco["annotations"]) == 4
    for image in coco["images"]:
        pixels = cv2.imread(str(tmp_path / "out" / image["file_name"]))
        assert pixels is not None
        assert (pixels.shape[1], pixels.shape[0]) == (image["width"], image["height"]) == (160, 120)
    person = next(a for a in coco["annotations"] if a["category_id"] == 1)
    assert person["bbox"] == [16.0, 12.0, 32.0, 48.0]  # halved: the 320x240 frame became 160x120
    assert person["score"] == 0.4


def test_folders_export_puts_each_jpeg_under_its_top_label(tmp_path: Path) -> None:
    store = SampleStore(tmp_path / "store")
    store.add("dev-a", _sample(_low_class("cat"), 1))
    store.add("dev-a", _sample(_low_class("../escape"), 2))
    store.add("dev-a", _sample(_low_boxes(), 3))
    summary = export_samples(store, "folders", tmp_path / "out")
    assert (summary.images, summary.skipped) == (2, 1)
    folders = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert folders == ["_escape", "cat"]
    for folder in folders:
        (jpeg,) = (tmp_path / "out" / folder).glob("*.jpg")
        assert cv2.imread(str(jpeg)) is not None


def _read_frame(path: Path) -> int:
    frame = json.loads(path.read_text())["sample"]["frame"]
    assert isinstance(frame, int)
    return frame


def test_a_resent_sample_is_kept_once(tmp_path: Path) -> None:
    store = SampleStore(tmp_path)
    sample = _sample(_low_class(), 1)
    assert store.add("cam-1", sample) is not None
    assert store.add("cam-1", sample) is None  # the QoS 1 resend of the same msg_id
    assert store.add("cam-2", sample) is not None  # another device's message is its own
    assert len(store.samples()) == 2
