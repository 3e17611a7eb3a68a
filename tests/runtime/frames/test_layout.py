"""Inference layout: how many workers a slot runs, from its config, streams and the machine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent.config import SlotConfig, StreamConfig
from agent.runtime.frames.layout import (
    MAX_AUTO_WORKERS,
    THROUGHPUT_PUBLISH_WAKE,
    inference_layout,
    slot_layout,
    unpaced,
)


def stream(source: dict[str, Any], **fields: Any) -> StreamConfig:
    return StreamConfig.model_validate({"source": source, "slot": "cls", **fields})


FILE = {"type": "file", "path": "clip.mp4"}


def test_a_configured_count_always_wins() -> None:
    layout = inference_layout(3, backend="tensorrt", providers=[], cpus=1, unpaced_only=False)
    assert (layout.workers, layout.reason, layout.max_batch, layout.publish_wake) == (
        3,
        "configured",
        None,
        1,
    )


@pytest.mark.parametrize(
    ("backend", "providers", "cpus", "unpaced_only", "model_ms", "workers", "why"),
    [
        ("onnxruntime", ["CPUExecutionProvider"], 2, True, None, 2, "unpaced files on 2 cores"),
        ("onnxruntime", ["CPUExecutionProvider"], 2, True, 14.0, 2, "unpaced files"),
        ("onnxruntime", ["CPUExecutionProvider"], 12, True, None, MAX_AUTO_WORKERS, "12 cores"),
        ("onnxruntime", ["CPUExecutionProvider"], 2, True, 0.8, 1, "small model (0.80 ms"),
        ("onnxruntime", ["CPUExecutionProvider"], 2, False, None, 1, "lowest latency"),
        ("onnxruntime", ["CPUExecutionProvider"], 1, True, None, 1, "one core"),
        ("onnxruntime", ["CUDAExecutionProvider", "CPUExecutionProvider"], 8, True, None, 1, "CUDA"),
        ("onnxruntime", [("TensorrtExecutionProvider", {"fp16": 1})], 8, True, None, 1, "Tensorrt"),
        ("tensorrt", [], 8, True, None, 1, "backend tensorrt"),
    ],
)
def test_auto_layout(
    backend: str,
    providers: list[Any],
    cpus: int,
    unpaced_only: bool,
    model_ms: float | None,
    workers: int,
    why: str,
) -> None:
    layout = inference_layout(
        0, backend=backend, providers=providers, cpus=cpus, unpaced_only=unpaced_only, model_ms=model_ms
    )
    assert layout.workers == workers
    # Several single-threaded CPU runs take one frame each; otherwise the slot's max_batch holds.
    assert layout.max_batch == (1 if workers > 1 else None)
    # ... and their results wake the publisher a few at a time: nothing waits on one of them.
    assert layout.publish_wake == (THROUGHPUT_PUBLISH_WAKE if workers > 1 else 1)
    assert layout.reason.startswith("auto")
    assert why in layout.reason


@pytest.mark.parametrize(
    ("source", "fields", "expected"),
    [
        (FILE, {}, True),
        ({**FILE, "realtime": True}, {}, False),  # paced like a camera
        (FILE, {"fps_limit": 5}, False),
        (FILE, {"drop_policy": "keep_newest"}, False),
        (FILE, {"drop_policy": "process_all"}, True),
        ({"type": "synthetic", "fps": 0}, {}, False),
        ({"type": "v4l2"}, {"drop_policy": "process_all"}, False),
    ],
)
def test_which_streams_are_unpaced(source: dict[str, Any], fields: dict[str, Any], expected: bool) -> None:
    assert unpaced(stream(source, **fields)) is expected


def test_one_live_stream_keeps_the_slot_on_the_latency_layout(tmp_path: Path) -> None:
    slot = SlotConfig(model=tmp_path / "m.onnx")
    files = [stream(FILE), stream(FILE)]
    assert slot_layout(slot, files, cpus=4).workers == 4
    assert slot_layout(slot, [*files, stream({"type": "v4l2"})], cpus=4).workers == 1
    assert slot_layout(slot, [], cpus=4).workers == 1  # no stream: nothing to be fast for
    explicit = SlotConfig(model=tmp_path / "m.onnx", inference_workers=2)
    assert slot_layout(explicit, [stream({"type": "v4l2"})], cpus=4).workers == 2


@pytest.mark.parametrize(("configured", "workers"), [(0, 3), (1, 3), (2, 3), (4, 4)])
def test_a_slot_on_three_engines_runs_at_least_one_worker_per_engine(configured: int, workers: int) -> None:
    layout = inference_layout(
        configured, backend="tensorrt", providers=(), cpus=2, unpaced_only=False, engines=3
    )
    assert layout.workers == workers
