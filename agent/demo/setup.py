"""What the demo runs on: its video, its models, its files and the agent's config for them.

Also used by the tests and benchmarks for a video of known content (:func:`write_demo_video`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import onnx

from agent.datasets import shapes
from agent.demo.modelzoo import write_classifier
from agent.fleet.deploy.keys import KeyPairFiles

DEVICE = "demo-orin-01"
PREFIX = "fleet/v1"


def write_demo_video(
    path: Path, frames: int = 150, size: tuple[int, int] = (640, 480), fps: float = 15.0
) -> Path:
    """A video of moving coloured shapes (MJPG in AVI: readable by every OpenCV build)."""
    width, height = size
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter.fourcc(*"MJPG"), fps, (width, height))
    if not writer.isOpened():
        raise RuntimeError(f"OpenCV cannot write {path}")
    rng = np.random.default_rng(7)
    colours = [tuple(int(c) for c in rng.integers(40, 255, 3)) for _ in range(4)]
    for i in range(frames):
        image = np.full((height, width, 3), 30, np.uint8)
        t = i / frames * 2 * np.pi
        cx, cy = int(width / 2 + width / 3 * np.cos(t)), int(height / 2 + height / 3 * np.sin(t))
        cv2.circle(image, (cx, cy), 50, colours[0], -1)
        cv2.rectangle(image, (width - cx - 40, cy - 30), (width - cx + 40, cy + 30), colours[1], -1)
        cv2.putText(image, f"{i:04d}", (10, 40), cv2.FONT_HERSHEY_SIMPLEX, 1.2, (255, 255, 255), 2)
        writer.write(image)
    writer.release()
    return path


def write_shapes_video(
    path: Path, *, shapes_count: int = 20, hold: int = 8, size: int = 320, fps: float = 15.0, seed: int = 2024
) -> tuple[Path, list[int]]:
    """A video of the shapes the trained classifier knows, each held for ``hold`` frames.

    Returns the path and the true class of each shape: frame ``i`` shows
    ``truth[(i // hold) % len(truth)]`` (the stream loops). Images come from
    :func:`agent.datasets.shapes.generate` with a seed the classifier was not trained on.
    """
    images, labels = shapes.generate(shapes_count, seed=seed, size=64)
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter.fourcc(*"MJPG"), fps, (size, size))
    if not writer.isOpened():
        raise RuntimeError(f"OpenCV cannot write {path}")
    for image in images:
        frame = cv2.resize(image, (size, size), interpolation=cv2.INTER_LINEAR)
        for _ in range(hold):
            writer.write(frame)
    writer.release()
    return path, [int(label) for label in labels]


@dataclass(frozen=True)
class DemoModels:
    """The classifier versions the demo deploys, and what the video shows."""

    factory: Path  # what the device ships with (its config names it)
    v1: Path
    v2: Path
    labels: list[str]
    trained: bool  # the trained shapes classifier (else random weights)


def reexport(source: Path, target: Path, version: int) -> Path:
    """The same network with another ``model_version`` (different bytes, different SHA-256)."""
    model = onnx.load(str(source))
    model.model_version = version
    model.doc_string = f"{model.doc_string} (re-exported as version {version})".strip()
    onnx.save(model, str(target))
    return target


def demo_models(workdir: Path) -> DemoModels:
    """v1 = the trained shapes classifier when it is in agent/assets, v2 = it re-exported; else random."""
    factory = write_classifier(workdir / "classifier-factory.onnx", input_size=64, num_classes=5, seed=0)
    if shapes.MODEL_PATH.exists() and shapes.LABELS_PATH.exists():
        v1 = workdir / "classifier-v1.onnx"
        v1.write_bytes(shapes.MODEL_PATH.read_bytes())
        v2 = reexport(v1, workdir / "classifier-v2.onnx", 2)
        labels = [line.strip() for line in shapes.LABELS_PATH.read_text().splitlines() if line.strip()]
        return DemoModels(factory, v1, v2, labels, trained=True)
    v1 = write_classifier(workdir / "classifier-v1.onnx", input_size=64, num_classes=5, seed=1)
    v2 = write_classifier(workdir / "classifier-v2.onnx", input_size=64, num_classes=5, seed=2)
    return DemoModels(factory, v1, v2, list(shapes.CLASSES), trained=False)


@dataclass(frozen=True)
class DemoFiles:
    """What the demo writes before it starts the agent."""

    workdir: Path
    port: int
    models: DemoModels
    detector: Path
    video: Path
    truth: list[int]
    hold: int
    key: KeyPairFiles

    @property
    def config_path(self) -> Path:
        return self.workdir / "agent.yaml"

    def true_label(self, frame_index: int) -> str:
        """The class the video shows at ``frame_index``."""
        return self.models.labels[self.truth[(frame_index // self.hold) % len(self.truth)]]


def demo_config(files: DemoFiles, detector_version: str = "1") -> dict[str, Any]:
    """The agent config the demo runs: a video stream on the classifier, a synthetic camera on the
    detector; the classifier starts on its factory model and trusts the demo's signing key.
    ``detector_version`` "2" points the detector slot at its second model (the SIGHUP hot-swap)."""
    detector = files.detector if detector_version == "1" else detector_v2(files.workdir)
    return {
        "device_id": DEVICE,
        "state_dir": str(files.workdir / "state"),
        "mqtt": {"host": "127.0.0.1", "port": files.port, "prefix": PREFIX, "keepalive_s": 10},
        "delivery": {"trusted_keys": {files.key.key_id: str(files.key.public)}},
        "slots": {
            "classifier": {
                "model": str(files.models.factory),
                "model_id": "shapes-classifier",
                "version": "0-factory",
                "preprocess": {"width": 64, "height": 64},
                "postprocess": {"type": "classification", "top_k": 3, "labels": files.models.labels},
            },
            "detector": {
                "model": str(detector),
                "model_id": "toy-detector",
                "version": detector_version,
                "preprocess": {"width": 320, "height": 320, "resize": "letterbox"},
                "postprocess": {"type": "detection", "format": "yolov8", "labels": ["circle", "box", "text"]},
            },
        },
        "streams": {
            "lobby": {
                "source": {"type": "file", "path": str(files.video), "loop": True, "realtime": True},
                "slot": "classifier",
                "drop_policy": "process_all",
                "results_qos": 1,
            },
            "gate": {
                "source": {"type": "synthetic", "width": 640, "height": 480, "fps": 10},
                "slot": "detector",
            },
        },
        "telemetry": {"interval_s": 5},
        "logging": {"format": "console", "level": "warning"},
    }


def detector_v2(workdir: Path) -> Path:
    """The detector's second version, swapped in by rewriting the config and sending SIGHUP."""
    return workdir / "detector-v2.onnx"
