"""bench/pipeline.py's direct figure of the sampler's cost measures real samples at the default rate."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from agent.config.models import SamplesConfig
from agent.demo.broker import Broker
from agent.demo.modelzoo import write_tiny_classifier
from agent.demo.setup import write_demo_video
from agent.specs.preprocess import PreprocessSpec


def _bench_pipeline() -> ModuleType:
    """bench/pipeline.py loaded from its file: bench/ is a folder of scripts, not a package (mypy
    checks each as a top-level module, and would see it twice if imported as ``bench.pipeline``)."""
    path = Path(__file__).resolve().parents[1] / "bench" / "pipeline.py"
    spec = importlib.util.spec_from_file_location("bench_pipeline", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sampling_cost_runs_a_simulated_minute_and_publishes_the_default_rate(
    tmp_path: Path, broker: Broker
) -> None:
    video = write_demo_video(tmp_path / "v.avi", frames=12, fps=30.0)
    model = write_tiny_classifier(tmp_path / "tiny.onnx", input_size=32, width=16)
    bench = _bench_pipeline()
    pairs = bench.case_results(model, PreprocessSpec(width=32, height=32), video)
    assert len(pairs) == 12
    assert all(message.classes for _image, message in pairs)
    link = bench._link(broker.port, tmp_path / "link", "bench-sampling-test")
    try:
        cost = bench.bench_sampling_cost(pairs, fps=100.0, agent_cpu_s_per_frame=0.002, link=link, repeat=1)
    finally:
        link.stop()
    # One minute of frames at 100 fps, every one under the bar: the default rate keeps exactly its
    # per-minute count, and those were encoded and published inside the measured window.
    assert cost["frames_simulated"] == 6000
    assert cost["simulated_s"] == 60.0
    assert cost["samples_published"] == SamplesConfig().per_minute
    assert cost["sampling_off_cost_fraction"] >= 0.0


def test_preprocess_cpu_is_measured_per_decoded_frame(tmp_path: Path) -> None:
    video = write_demo_video(tmp_path / "v.avi", frames=6, fps=30.0)
    figure = _bench_pipeline().bench_preprocess_cpu(PreprocessSpec(width=32, height=32), video)
    assert set(figure) == {"cpu_s_per_frame"}
    assert figure["cpu_s_per_frame"] >= 0.0
