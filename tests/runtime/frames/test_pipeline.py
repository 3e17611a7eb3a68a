"""SlotPipeline in-process: real sources, real ONNX Runtime, a real MqttLink to the session's mosquitto."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import cv2
import numpy as np
import pytest

from agent.camera.preprocess import Letterbox, preprocess
from agent.camera.source import VideoSource
from agent.camera.source_spec import FileSourceSpec, SyntheticSourceSpec
from agent.demo.broker import Broker
from agent.demo.modelzoo import write_classifier
from agent.demo.setup import write_demo_video
from agent.mqtt.link import MqttLink
from agent.mqtt.settings import MqttSettings
from agent.protocol.messages import ResultMessage, decode
from agent.runtime.frames.pipeline import SlotPipeline, publishes_inline
from agent.runtime.frames.stage_items import StreamPlan
from agent.runtime.frames.stage_queue import DropPolicy
from agent.runtime.slots.loaded import EngineReport, ModelSource
from agent.runtime.slots.slot import ModelSlot
from agent.specs.postprocess import ClassificationSpec
from agent.specs.preprocess import PreprocessSpec
from agent.spool.queue import Spool
from agent.telemetry import Metrics
from tests.camera.specs import make
from tests.mqtt_probe import Probe
from tests.runtime.models import write_slow_classifier, write_static_batch_classifier
from tests.waiting import patient, wait_until

SIZE = 32


def model_source(path: Path, version: str = "1") -> ModelSource:
    return ModelSource(
        path=path,
        model_id=path.stem,
        version=version,
        backend="onnxruntime",
        providers=("CPUExecutionProvider",),
        intra_op_threads=1,
        preprocess=PreprocessSpec(width=SIZE, height=SIZE),
        postprocess=ClassificationSpec(top_k=1),
    )


@dataclass
class Rig:
    """One slot's pipeline publishing through a real link; a probe subscribed to its results."""

    device: str
    link: MqttLink
    probe: Probe
    metrics: Metrics
    pipelines: list[SlotPipeline]

    def topic(self, stream: str) -> str:
        return f"fleet/v1/{self.device}/up/results/{stream}"

    def results(self, stream: str) -> list[ResultMessage]:
        """Results of ``stream`` by frame index, QoS 1 resends (same msg_id) removed."""
        seen: dict[str, ResultMessage] = {}
        for m in self.probe.on_topic(self.topic(stream)):
            result = decode(ResultMessage, m.payload)
            seen.setdefault(result.msg_id, result)
        return sorted(seen.values(), key=lambda r: r.frame_index)

    def counter(self, name: str) -> float:
        return self.metrics.snapshot().get(name, 0.0)

    def start(
        self,
        slot: ModelSlot,
        streams: dict[str, tuple[object, DropPolicy]],
        *,
        max_batch: int = 4,
        queue_size: int = 4,
        workers: int = 1,
        publish_wake: int = 1,
    ) -> SlotPipeline:
        plans = [
            StreamPlan(
                name=name,
                source=VideoSource(name, spec),  # type: ignore[arg-type]
                slot=slot.name,
                topic=self.topic(name),
                policy=policy,
                queue_size=queue_size,
                qos=1,
            )
            for name, (spec, policy) in streams.items()
        ]
        pipeline = SlotPipeline(
            slot,
            plans,
            self.link,
            self.metrics,
            max_batch=max_batch,
            workers=workers,
            publish_wake=publish_wake,
        )
        self.pipelines.append(pipeline)
        pipeline.start()
        return pipeline


@pytest.fixture
def rig(broker: Broker, tmp_path: Path) -> Iterator[Rig]:
    device = f"rt-{uuid.uuid4().hex[:8]}"
    spool = Spool(tmp_path / "spool.sqlite")
    link = MqttLink(
        MqttSettings(host=broker.host, port=broker.port, reconnect_min_s=0.05, reconnect_max_s=0.3),
        client_id=device,
        status_topic=f"fleet/v1/{device}/up/status",
        agent_version="0.0.test",
        spool=spool,
    )
    link.start()
    probe = Probe(broker.host, broker.port)
    probe.subscribe(f"fleet/v1/{device}/up/results/#")
    wait_until(lambda: link.connected, timeout=30.0, what="the link to connect")
    rig = Rig(device, link, probe, Metrics(), [])
    try:
        yield rig
    finally:
        for pipeline in rig.pipelines:
            pipeline.stop(time.monotonic() + patient(5.0))
            pipeline.slot.close()
        link.stop(timeout=2.0)
        probe.close()
        spool.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pipeline-models")
    return {
        "v1": write_classifier(root / "v1.onnx", input_size=SIZE, num_classes=4, seed=1),
        "v2": write_classifier(root / "v2.onnx", input_size=SIZE, num_classes=4, seed=2),
        "slow": write_slow_classifier(root / "slow.onnx", input_size=SIZE, dim=384, repeats=6),
        "batch1": write_static_batch_classifier(root / "batch1.onnx", input_size=SIZE),
    }


def synthetic(frames: int, fps: float = 0.0) -> SyntheticSourceSpec:
    return make(SyntheticSourceSpec, width=64, height=48, fps=fps, frames=frames)


def loaded_slot(path: Path) -> ModelSlot:
    slot = ModelSlot("cls")
    slot.load(model_source(path))
    return slot


def test_a_file_stream_yields_one_result_per_frame_then_finishes(
    rig: Rig, models: dict[str, Path], tmp_path: Path
) -> None:
    video = write_demo_video(tmp_path / "clip.avi", frames=40, size=(96, 72), fps=30.0)
    spec = make(FileSourceSpec, path=video, loop=False, realtime=False)
    pipeline = rig.start(loaded_slot(models["v1"]), {"clip": (spec, "process_all")}, queue_size=2)
    wait_until(lambda: pipeline.finished, timeout=30.0, what="the play-once file to be processed to the end")
    assert pipeline.healthy(stale_s=0.0)  # ended on purpose: not a stuck frame loop
    rig.probe.wait_for(lambda _ms: len(rig.results("clip")) >= 40, timeout=10)
    results = rig.results("clip")
    assert [r.frame_index for r in results] == list(range(40))
    assert all(r.stream == "clip" and r.model.version == "1" for r in results)
    assert all(r.classes is not None and len(r.classes) == 1 for r in results)
    assert rig.counter("stream.clip.frames_published") == 40
    assert rig.counter("stream.clip.dropped.queue_full") == 0


@pytest.mark.parametrize("publish_wake", [1, 4])  # 4: as the throughput layout wakes the publisher
def test_several_inference_workers_publish_every_frame_once_in_frame_order(
    rig: Rig, models: dict[str, Path], tmp_path: Path, publish_wake: int
) -> None:
    video = write_demo_video(tmp_path / "clip.avi", frames=60, size=(96, 72), fps=30.0)
    spec = make(FileSourceSpec, path=video, loop=False, realtime=False)
    pipeline = rig.start(
        loaded_slot(models["slow"]),
        {"clip": (spec, "process_all")},
        max_batch=2,
        queue_size=4,
        workers=3,
        publish_wake=publish_wake,
    )
    assert len([t for t in pipeline._threads if t.name.startswith("infer-")]) == 3
    wait_until(lambda: pipeline.finished, timeout=30.0, what="three workers to drain the file")
    rig.probe.wait_for(lambda _ms: len(rig.results("clip")) >= 60, timeout=10)
    assert [r.frame_index for r in rig.results("clip")] == list(range(60))
    # Workers finish batches in any order (batches of 1 and 2 on a slow model); the outbox restores
    # the order they were taken in, so results arrive in frame order (QoS 1 from one client keeps it).
    arrival: list[int] = []
    for m in rig.probe.on_topic(rig.topic("clip")):
        index = decode(ResultMessage, m.payload).frame_index
        if index not in arrival:
            arrival.append(index)
    assert arrival == list(range(60))
    assert rig.counter("stream.clip.frames_published") == 60


def test_streams_sharing_a_slot_are_batched(rig: Rig, models: dict[str, Path]) -> None:
    streams = {"left": (synthetic(24), "process_all"), "right": (synthetic(24), "process_all")}
    pipeline = rig.start(loaded_slot(models["slow"]), streams, max_batch=4)  # type: ignore[arg-type]
    wait_until(lambda: pipeline.finished, timeout=30.0, what="both streams to be processed")
    inferred = rig.counter("stream.left.frames_inferred") + rig.counter("stream.right.frames_inferred")
    batches = rig.counter("slot.cls.batches")
    assert inferred == 48
    assert 0 < batches < inferred
    rig.probe.wait_for(lambda _ms: len(rig.results("left")) + len(rig.results("right")) >= 48, timeout=10)
    for stream in ("left", "right"):
        assert [r.frame_index for r in rig.results(stream)] == list(range(24))
    totals = [r.latency_ms for r in rig.results("left")]
    assert all(t["infer"] >= 0.0 for t in totals)


def test_a_model_with_a_fixed_batch_of_one_serves_two_streams(rig: Rig, models: dict[str, Path]) -> None:
    """A static batch axis caps the batch: stacking frames from two streams must not fail every run."""
    streams = {"left": (synthetic(12), "process_all"), "right": (synthetic(12), "process_all")}
    pipeline = rig.start(loaded_slot(models["batch1"]), streams, max_batch=4)  # type: ignore[arg-type]
    wait_until(lambda: pipeline.finished, timeout=30.0, what="both streams to be processed")
    assert rig.counter("stream.left.dropped.infer_error") == 0
    assert rig.counter("stream.right.dropped.infer_error") == 0
    assert rig.counter("stream.left.frames_inferred") + rig.counter("stream.right.frames_inferred") == 24
    assert rig.counter("slot.cls.batches") == 24


def test_keep_newest_with_a_slow_model_drops_queue_full(rig: Rig, models: dict[str, Path]) -> None:
    streams = {"live": (synthetic(300), "keep_newest")}
    pipeline = rig.start(loaded_slot(models["slow"]), streams, max_batch=1, queue_size=2)  # type: ignore[arg-type]
    wait_until(lambda: pipeline.finished, timeout=30.0, what="the burst to end")
    captured = rig.counter("stream.live.frames_captured")
    published = rig.counter("stream.live.frames_published")
    dropped = rig.counter("stream.live.dropped.queue_full")
    assert captured == 300
    assert dropped > 0
    assert published + dropped == captured  # every frame is either published or counted as dropped
    rig.probe.wait_for(lambda _ms: len(rig.results("live")) >= published, timeout=10)
    indices = [r.frame_index for r in rig.results("live")]
    assert len(indices) == published
    assert indices[-1] == 299  # the newest frame is kept, the old ones give way


@pytest.mark.parametrize("workers", [1, 2])
def test_a_swap_while_streaming_loses_no_frame(rig: Rig, models: dict[str, Path], workers: int) -> None:
    slot = loaded_slot(models["v1"])
    pipeline = rig.start(
        slot, {"cam": (synthetic(200, fps=100.0), "process_all")}, queue_size=2, workers=workers
    )
    rig.probe.wait_for(lambda _ms: len(rig.results("cam")) >= 20, timeout=20)
    swapper = threading.Thread(target=slot.load, args=(model_source(models["v2"], "2"),))
    swapper.start()
    swapper.join(patient(20))
    wait_until(lambda: pipeline.finished, timeout=30.0, what="the stream to end")
    rig.probe.wait_for(lambda _ms: len(rig.results("cam")) >= 200, timeout=10)
    results = rig.results("cam")
    assert [r.frame_index for r in results] == list(range(200)), "a frame index is missing or repeated"
    versions = [r.model.version for r in results]
    switch = versions.index("2")
    assert 0 < switch < 200
    # In frame order, even with two workers: no v1 result after the first v2 one.
    assert set(versions[:switch]) == {"1"}
    assert set(versions[switch:]) == {"2"}
    assert results[0].model.sha256 != results[-1].model.sha256
    assert slot.swaps == 1


# -- one slot on several engines (build.devices) -------------------------------------------------
# Several ONNX Runtime CPU sessions stand in for the devices (DLA0, DLA1, GPU) a Jetson would run:
# no machine here has them. The path is the daemon's own: one LoadedModel per engine, one inference
# worker per engine, the ordered outbox, a real link to the session's mosquitto.

#: The devices a Jetson slot would span; each is a CPU session here.
STAND_INS = ("dla0", "dla1", "gpu")


def engine_set(path: Path, version: str = "1") -> ModelSource:
    """A three-engine source of ``path``: the first engine and two more, each its own CPU session."""
    sources = [
        replace(model_source(path, version), report=EngineReport(device="cpu", precision="fp32", requested=d))
        for d in STAND_INS
    ]
    return replace(sources[0], engines=tuple(sources[1:]))


def test_a_slot_on_three_engines_publishes_every_frame_once_in_order_and_each_engine_gets_a_share(
    rig: Rig, models: dict[str, Path], tmp_path: Path
) -> None:
    slot = ModelSlot("cls", parallel_runs=3)
    loaded = slot.load(engine_set(models["slow"]))
    assert len(loaded.engines) == 3
    assert len({id(e.runner) for e in loaded.engines}) == 3, "each engine is its own session"
    video = write_demo_video(tmp_path / "clip.avi", frames=60, size=(96, 72), fps=30.0)
    spec = make(FileSourceSpec, path=video, loop=False, realtime=False)
    pipeline = rig.start(slot, {"clip": (spec, "process_all")}, max_batch=1, queue_size=6, workers=3)
    wait_until(lambda: pipeline.finished, timeout=60.0, what="three engines to drain the file")
    rig.probe.wait_for(lambda _ms: len(rig.results("clip")) >= 60, timeout=10)
    assert [r.frame_index for r in rig.results("clip")] == list(range(60))
    rows = slot.describe()["engines"]
    assert [row["requested"] for row in rows] == list(STAND_INS)
    assert sum(row["frames"] for row in rows) == 60
    assert all(row["frames"] > 0 for row in rows), f"an engine got no frames: {rows}"
    assert abs(sum(row["share"] for row in rows) - 1.0) < 1e-3


def test_a_hot_swap_of_a_three_engine_slot_loses_no_frame_and_never_mixes_versions(
    rig: Rig, models: dict[str, Path]
) -> None:
    slot = ModelSlot("cls", parallel_runs=3)
    old = slot.load(engine_set(models["v1"]))
    pipeline = rig.start(slot, {"cam": (synthetic(240, fps=100.0), "process_all")}, queue_size=2, workers=3)
    rig.probe.wait_for(lambda _ms: len(rig.results("cam")) >= 30, timeout=20)
    swapper = threading.Thread(target=slot.load, args=(engine_set(models["v2"], "2"),))
    swapper.start()
    swapper.join(patient(20))
    wait_until(lambda: pipeline.finished, timeout=30.0, what="the stream to end")
    rig.probe.wait_for(lambda _ms: len(rig.results("cam")) >= 240, timeout=10)
    results = rig.results("cam")
    assert [r.frame_index for r in results] == list(range(240)), "a frame index is missing or repeated"
    versions = [r.model.version for r in results]
    switch = versions.index("2")
    assert 0 < switch < 240
    assert set(versions[:switch]) == {"1"}
    assert set(versions[switch:]) == {"2"}, "an old-version result came after the first new one"
    # The whole old set went out together: every engine of it drained and closed.
    assert {e.state.value for e in old.engines} == {"released"}
    new = slot.current
    assert new is not None
    assert sum(e.frames for e in new.engines) == 240 - switch


class _StandInPinnedFrames:
    """Stands in for :class:`agent.camera.gpu_preprocess.PinnedFrames` (no CUDA here): plain numpy
    buffers, remembered by address, so the test sees whether frames were decoded into them."""

    def __init__(self) -> None:
        self.made: set[int] = set()

    def empty(self, shape: tuple[int, ...]) -> np.ndarray:
        image = np.empty(shape, np.uint8)
        self.made.add(image.ctypes.data)
        return image

    def holds(self, image: np.ndarray) -> bool:
        return image.ctypes.data in self.made


class _CpuStandInForGpuPreprocessing:
    """Stands in for :class:`agent.camera.gpu_preprocess.GpuPreprocessor` (no GPU on this machine).

    Same ``batch`` contract, computed with the CPU path, so the pipeline's GPU branch (capture leaves
    frames as decoded, the inference worker fills the batch) runs here; the GPU kernel itself is
    checked against the CPU path by the ``gpu`` tests in tests/camera/test_gpu_preprocess.py.
    """

    def __init__(self, spec: PreprocessSpec, pinned: _StandInPinnedFrames) -> None:
        self.spec = spec
        self.pinned = pinned
        self.frame_shapes: list[tuple[int, ...]] = []
        #: Frames that reached this engine in a buffer ``pinned`` made (decoded straight into it).
        self.in_made_buffers = 0

    def batch(self, images: list[np.ndarray]) -> tuple[np.ndarray, list[Letterbox]]:
        self.frame_shapes.extend(image.shape for image in images)
        self.in_made_buffers += sum(self.pinned.holds(image) for image in images)
        done = [preprocess(image, self.spec) for image in images]
        return np.stack([tensor for tensor, _ in done]), [letterbox for _, letterbox in done]


@pytest.mark.parametrize("gpu_engines", [(0, 1, 2), (1,)], ids=["every-engine", "one-of-three"])
def test_frames_left_for_gpu_preprocessing_reach_the_engine_whole_and_publish_the_same_results(
    rig: Rig, models: dict[str, Path], tmp_path: Path, gpu_engines: tuple[int, ...]
) -> None:
    video = write_demo_video(tmp_path / "clip.avi", frames=30, size=(96, 72), fps=30.0)
    spec = make(FileSourceSpec, path=video, loop=False, realtime=False)
    cpu_rig_slot = loaded_slot(models["v1"])
    reference = rig.start(cpu_rig_slot, {"ref": (spec, "process_all")}, queue_size=30)
    wait_until(lambda: reference.finished, timeout=30.0, what="the CPU-path run to finish")

    slot = ModelSlot("cls", parallel_runs=3)
    loaded = slot.load(engine_set(models["v1"]))
    pinned = _StandInPinnedFrames()
    stand_ins = {i: _CpuStandInForGpuPreprocessing(loaded.preprocess, pinned) for i in gpu_engines}
    for i, stand_in in stand_ins.items():
        loaded.engines[i].gpu_preprocessor = cast(Any, stand_in)
    assert loaded.preprocessed_on_gpu is (len(gpu_engines) == 3)
    pipeline = rig.start(slot, {"clip": (spec, "process_all")}, max_batch=2, queue_size=30, workers=3)
    wait_until(lambda: pipeline.finished, timeout=30.0, what="the GPU-branch run to finish")
    rig.probe.wait_for(
        lambda _ms: len(rig.results("clip")) >= 30 and len(rig.results("ref")) >= 30, timeout=10
    )
    got, expected = rig.results("clip"), rig.results("ref")
    assert [r.frame_index for r in got] == list(range(30))
    assert [r.classes for r in got] == [r.classes for r in expected]
    seen = [shape for stand_in in stand_ins.values() for shape in stand_in.frame_shapes]
    # Which worker takes which batch is the scheduler's choice (one of three engines may run none
    # on a loaded machine): every frame an engine of the GPU branch ran reached it whole.
    assert len(seen) == sum(loaded.engines[i].frames for i in gpu_engines)
    assert all(shape == (72, 96, 3) for shape in seen), "full-size decoded frames, not CPU tensors"
    in_made = sum(stand_in.in_made_buffers for stand_in in stand_ins.values())
    if len(gpu_engines) == 3:
        assert len(seen) == 30
        # The slot preprocesses on the GPU: the source decodes into the preprocessor's (page-locked)
        # buffers once the first frame showed it, as many as are free (the queue holds up to 30).
        assert in_made > 0
        assert 0 < len(pinned.made) <= 12
    else:
        assert (in_made, len(pinned.made)) == (0, 0)  # CPU preprocessing: the decoder's own arrays


# -- the lean frame path: inline publishing, pooled frame buffers -------------------------------


def test_one_worker_publishes_inline_unless_a_stream_is_durable_and_several_workers_never_do() -> None:
    def plan(name: str, *, durable: bool) -> StreamPlan:
        source = VideoSource(name, synthetic(1))
        return StreamPlan(name, source, "cls", f"t/{name}", "process_all", durable=durable)

    assert publishes_inline(1, [plan("a", durable=False), plan("b", durable=False)])
    assert not publishes_inline(1, [plan("a", durable=False), plan("b", durable=True)])
    assert not publishes_inline(2, [plan("a", durable=False)])


def test_a_lone_worker_publishes_every_frame_in_order_with_no_publish_thread(
    rig: Rig, models: dict[str, Path], tmp_path: Path
) -> None:
    video = write_demo_video(tmp_path / "clip.avi", frames=50, size=(96, 72), fps=30.0)
    spec = make(FileSourceSpec, path=video, loop=False, realtime=False)
    pipeline = rig.start(loaded_slot(models["v1"]), {"clip": (spec, "process_all")}, queue_size=2)
    assert pipeline.inline_publish
    assert [t.name for t in pipeline._threads] == ["capture-clip", "infer-cls-0"]
    wait_until(lambda: pipeline.finished, timeout=30.0, what="the play-once file to be processed")
    rig.probe.wait_for(lambda _ms: len(rig.results("clip")) >= 50, timeout=10)
    arrival: list[int] = []
    for m in rig.probe.on_topic(rig.topic("clip")):
        index = decode(ResultMessage, m.payload).frame_index
        if index not in arrival:
            arrival.append(index)
    assert arrival == list(range(50))
    assert rig.counter("stream.clip.frames_published") == 50
    latest = pipeline.snapshots.latest("clip")
    assert latest is not None
    assert latest.result.frame_index == 49


def test_snapshots_keep_their_own_pixels_while_the_source_decodes_into_reused_buffers(
    rig: Rig, models: dict[str, Path], tmp_path: Path
) -> None:
    # A looping file: the source decodes into the same few pooled buffers again and again, while the
    # snapshot board (and this test) hold frames. Each held frame must stay the frame it was.
    frames = 30
    video = write_demo_video(tmp_path / "clip.avi", frames=frames, size=(96, 72), fps=30.0)
    reference = _decoded(video)
    spec = make(FileSourceSpec, path=video, loop=True, realtime=False)
    slot = loaded_slot(models["v1"])
    pipeline = rig.start(slot, {"clip": (spec, "process_all")}, queue_size=2)
    held = []
    for round_ in range(1, 6):
        published = round_ * 2 * frames
        wait_until(
            lambda: rig.counter("stream.clip.frames_published") >= published,  # noqa: B023 - called now
            timeout=30.0,
            what="two more loops of the file",
        )
        snapshot = pipeline.snapshots.latest("clip")
        assert snapshot is not None
        np.testing.assert_array_equal(snapshot.image, reference[snapshot.result.frame_index % frames])
        held.append(snapshot)
    pool = pipeline.streams[0].source._driver.buffers
    assert pool.reused > 4 * frames  # the buffers were decoded into again meanwhile
    for snapshot in held:
        np.testing.assert_array_equal(snapshot.image, reference[snapshot.result.frame_index % frames])


def _decoded(video: Path) -> list[np.ndarray]:
    """Every frame of ``video``, each decoded into its own new array."""
    cap, out = cv2.VideoCapture(str(video)), []
    while (read := cap.read())[0]:
        out.append(read[1])
    cap.release()
    return out
