"""Frame-path benchmark: raw inference vs a naive loop vs the agent, in one run, as JSON.

Cases: a MobileNet-sized 224x224 classifier (inference-bound) and a tiny classifier (decode costs
about as much as inference), both on a 640x480 video. Results go to a local mosquitto in the
naive loop and in the agent alike. Also: capture-to-publish latency with a 30 fps paced source,
and the largest gap between consecutive results during a hot-swap at full rate.

Per case, ``overhead_ms_per_frame`` is the agent's own CPU per frame beyond decoding and inference:
the agent's process CPU per frame, minus decoding the same video on one FFmpeg thread into a reused
buffer (as the file source does: its drivers decode into a pool of buffers lent again once no stage
holds them, ``agent/camera/frame_pool.py``), minus inference through the agent's own backend with
its session options; all three measured in the same repeat, the median over repeats reported. The
pool's own bookkeeping, preprocessing, the queues, postprocessing and publishing are the overhead.
``preprocess_cpu_ms_per_frame`` is the part of it preprocessing alone costs: the case's decoded
frames through :func:`preprocess`, one thread, nothing else running in the process.
The bench's own main thread waits for the agent's last result with few wake-ups (half the expected
time left, then every 5 ms), so that the bench's own thread stays out of the measured CPU.

Per case, ``sampling_cost`` is the sampler's own CPU per frame, measured directly
because end-to-end runs differ by more than it costs. The case's frames and the results the agent
publishes for them (its backend, its default postprocess) go through the code the pipeline runs
per frame, :meth:`SnapshotBoard.inferred` and :meth:`SnapshotBoard.published`, for one simulated
minute at the case's own agent fps (the sampler's clock advances 1/fps per frame): with sampling
off (the app wires no sampler: the board only tests for one) and on at the default rate
(``per_minute`` 2, every frame under ``max_confidence`` 1.0, so each frame pays the decision and
the rate check, and each frame pairs with its result, as a batch of one does). With it on the
real :class:`SamplePublisher` thread encodes and publishes the kept frames to the bench broker
inside the measured window, so their cost is amortised over the minute's frames as on a device.
``on_cost_ms_per_frame`` is on minus off (process CPU, median over repeats), and
``off_cost_ms_per_frame`` the board's test for a sampler, timed alone; each as a fraction of the
agent's CPU per frame (``sampling_on_cost_fraction``, ``sampling_off_cost_fraction``).

    .venv/bin/python bench/pipeline.py [--frames 300]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import yaml

from agent.app.root import Agent
from agent.backends.base import LoadOptions, get_backend
from agent.camera.preprocess import preprocess
from agent.config import load_config
from agent.config.models import SamplesConfig
from agent.demo.broker import Broker
from agent.demo.modelzoo import write_mobilenet_like, write_tiny_classifier
from agent.demo.setup import write_demo_video
from agent.logs.setup import configure_logging
from agent.mqtt.link import MqttLink
from agent.mqtt.observer import Observer
from agent.mqtt.settings import MqttSettings
from agent.postprocess.runner import Postprocessor
from agent.protocol.messages import ModelRef, ResultMessage
from agent.runtime.frames.samples import SamplePublisher, Sampler, sample_reason
from agent.runtime.frames.snapshots import SnapshotBoard
from agent.specs.postprocess import ClassificationSpec
from agent.specs.preprocess import PreprocessSpec
from agent.spool.queue import Spool


def _median(samples: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the median over repeated runs."""
    return {key: statistics.median(sample[key] for sample in samples) for key in samples[0]}


def _frames(video: Path) -> list[np.ndarray[Any, Any]]:
    cap = cv2.VideoCapture(str(video))
    frames = []
    while True:
        ok, image = cap.read()
        if not ok:
            break
        frames.append(image)
    cap.release()
    return frames


def decode_ms(video: Path) -> float:
    """Milliseconds to decode one frame of ``video`` with OpenCV."""
    cap = cv2.VideoCapture(str(video))
    count, t0 = 0, time.perf_counter()
    while cap.read()[0]:
        count += 1
    cap.release()
    return (time.perf_counter() - t0) / max(count, 1) * 1000


def tiny_matching_decode(workdir: Path, video: Path) -> tuple[Path, int, dict[str, float]]:
    """The tiny classifier whose inference costs about what decoding a frame costs (the issue's case)."""
    target = decode_ms(video)
    best: tuple[float, Path, int, float] | None = None
    for size, width in ((32, 64), (32, 96), (32, 128), (48, 64), (48, 96), (64, 64)):
        model = write_tiny_classifier(workdir / f"tiny-{size}-{width}.onnx", input_size=size, width=width)
        session = _plain_session(model)
        x = np.random.default_rng(0).random((1, 3, size, size), dtype=np.float32)
        for _ in range(20):
            session.run(None, {"images": x})
        t0 = time.perf_counter()
        for _ in range(100):
            session.run(None, {"images": x})
        infer = (time.perf_counter() - t0) / 100 * 1000
        if best is None or abs(infer - target) < abs(best[0] - target):
            best = (infer, model, size, width)
    assert best is not None
    best_ms, best_model, best_size, best_width = best
    facts = {"decode_ms": target, "infer_ms": best_ms, "input_size": best_size, "width": best_width}
    return best_model, best_size, facts


def _plain_session(model: Path) -> Any:
    """What a user's own script would make: ONNX Runtime with its default options."""
    import onnxruntime as ort

    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])


def bench_raw(model: Path, spec: PreprocessSpec, video: Path) -> dict[str, float]:
    """session.run throughput on inputs preprocessed beforehand (batch 1): the ceiling."""
    session = _plain_session(model)
    name = session.get_inputs()[0].name
    inputs = [preprocess(image, spec)[0][np.newaxis] for image in _frames(video)]
    session.run(None, {name: inputs[0]})  # warm-up
    t0, c0 = time.perf_counter(), time.process_time()
    for tensor in inputs:
        session.run(None, {name: tensor})
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"fps": len(inputs) / wall, "cpu_s_per_frame": cpu / len(inputs)}


def bench_decode_cpu(video: Path) -> dict[str, float]:
    """CPU per frame of decoding ``video`` as the agent's file source does: one FFmpeg thread, each
    frame written into a buffer decoded into before (the source's ``FramePool`` lends a buffer
    again once no stage holds it; here each frame is let go before the next read, so one buffer)."""
    cap = cv2.VideoCapture(str(video), cv2.CAP_ANY, [cv2.CAP_PROP_N_THREADS, 1])
    count, c0 = 0, time.process_time()
    ok, buffer = cap.read()
    while ok:
        count += 1
        ok, _image = cap.read(buffer)
    cpu = time.process_time() - c0
    cap.release()
    return {"cpu_s_per_frame": cpu / max(count, 1)}


def bench_preprocess_cpu(spec: PreprocessSpec, video: Path) -> dict[str, float]:
    """CPU per frame of preprocessing alone (the capture thread's share of the overhead), on the
    case's decoded frames: what the agent pays per frame beside decoding and its queues."""
    frames = _frames(video)
    preprocess(frames[0], spec)  # warm-up: the geometry and coefficients are cached per frame size
    c0 = time.process_time()
    for image in frames:
        preprocess(image, spec)
    return {"cpu_s_per_frame": (time.process_time() - c0) / len(frames)}


def bench_agent_infer_cpu(model: Path, spec: PreprocessSpec, video: Path, threads: int) -> dict[str, float]:
    """CPU per frame of inference alone, as the agent runs it: its backend, its session options
    (``threads``: the intra-op threads the agent's run chose)."""
    runner = get_backend("onnxruntime").load(model, LoadOptions(intra_op_threads=threads))
    name = runner.inputs[0].name
    inputs = [preprocess(image, spec)[0][np.newaxis] for image in _frames(video)]
    runner.infer({name: inputs[0]})  # warm-up
    c0 = time.process_time()
    for tensor in inputs:
        runner.infer({name: tensor})
    cpu = time.process_time() - c0
    runner.close()
    return {"cpu_s_per_frame": cpu / len(inputs)}


def overhead_ms_per_frame(
    agent: dict[str, float], decode: dict[str, float], infer: dict[str, float]
) -> float:
    """The agent's own CPU per frame beyond decoding and inference (preprocess, queues, publish), ms."""
    return (agent["cpu_s_per_frame"] - decode["cpu_s_per_frame"] - infer["cpu_s_per_frame"]) * 1000.0


def _link(port: int, workdir: Path, name: str) -> MqttLink:
    workdir.mkdir(parents=True, exist_ok=True)
    link = MqttLink(
        MqttSettings(host="127.0.0.1", port=port),
        client_id=name,
        status_topic=f"bench/{name}/up/status",
        agent_version="bench",
        spool=Spool(workdir / f"{name}.sqlite"),
    )
    link.start()
    if not link.wait_connected(10):
        raise RuntimeError(f"bench link {name} did not connect to 127.0.0.1:{port}")
    return link


def bench_naive(model: Path, spec: PreprocessSpec, video: Path, port: int, workdir: Path) -> dict[str, float]:
    """read -> preprocess -> run -> postprocess -> publish, one frame at a time, one thread."""
    session = _plain_session(model)
    name = session.get_inputs()[0].name
    output_names = [o.name for o in session.get_outputs()]
    post = Postprocessor(ClassificationSpec(top_k=5))
    ref = ModelRef(slot="bench", model_id=model.stem, version="1", sha256="0" * 64)
    link = _link(port, workdir, "naive")
    cap = cv2.VideoCapture(str(video))
    count = 0
    t0, c0 = time.perf_counter(), time.process_time()
    while True:
        ok, image = cap.read()
        if not ok:
            break
        tensor, letterbox = preprocess(np.asarray(image, dtype=np.uint8), spec)
        outputs = session.run(None, {name: tensor[np.newaxis]})
        prediction = post({k: v[0] for k, v in zip(output_names, outputs, strict=True)}, letterbox)
        message = ResultMessage(
            stream="naive",
            frame_index=count,
            captured_at=time.time(),
            published_at=time.time(),
            model=ref,
            latency_ms={},
            classes=prediction.classes,
        )
        link.publish("bench/naive/up/results/naive", message, qos=0)
        count += 1
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    cap.release()
    link.stop()
    return {"fps": count / wall, "cpu_s_per_frame": cpu / count, "frames": count}


def _agent_config(
    workdir: Path,
    port: int,
    model: Path,
    size: int,
    video: Path,
    slot: dict[str, Any] | None = None,
    **source: Any,
) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {
        "device_id": "bench",
        "state_dir": str(workdir / "state"),
        "mqtt": {"host": "127.0.0.1", "port": port},
        "slots": {
            "cls": {"model": str(model), "version": "1", "preprocess": {"width": size, "height": size}},
        },
        "streams": {
            "cam": {
                "source": {"type": "file", "path": str(video), **source},
                "slot": "cls",
                "drop_policy": "process_all",
                "queue_size": 8,
            }
        },
        "telemetry": {"interval_s": 60},
        "logging": {"format": "json", "level": "error"},
    }
    config["slots"]["cls"].update(slot or {})
    path = workdir / "agent.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _run_agent(
    config_path: Path,
    until: Callable[[Agent], bool],
    timeout: float,
    poll_s: Callable[[Agent, float], float] = lambda _agent, _elapsed: 0.005,
) -> tuple[Agent, float, float]:
    """Run the agent until ``until(agent)``; ``poll_s(agent, elapsed)``: how long to wait between checks."""
    agent = Agent(load_config(config_path), config_path)
    agent.start()
    t0, c0 = time.perf_counter(), time.process_time()
    deadline = time.monotonic() + timeout
    while not until(agent) and time.monotonic() < deadline:
        time.sleep(poll_s(agent, time.perf_counter() - t0))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return agent, wall, cpu


def _published(agent: Agent) -> int:
    return agent.metrics.counter("stream.cam.frames_published").value


def _until_frames(frames: int) -> Callable[[Agent, float], float]:
    """Wait half the time the rest of ``frames`` should take at the rate so far, then 5 ms at a time.

    Few wake-ups of the bench's thread inside the measured process CPU, and the end still seen
    within 5 ms.
    """

    def poll_s(agent: Agent, elapsed: float) -> float:
        done = _published(agent)
        left = elapsed * (frames - done) / done if done else 0.05
        return min(0.5, max(0.005, left / 2))

    return poll_s


def bench_agent(
    model: Path,
    size: int,
    video: Path,
    port: int,
    workdir: Path,
    frames: int,
    slot: dict[str, Any] | None = None,
) -> dict[str, float]:
    """The agent in this process, file source processing every frame, until all are published."""
    path = _agent_config(workdir, port, model, size, video, slot, loop=False)
    agent, wall, cpu = _run_agent(path, lambda a: _published(a) >= frames, 300, _until_frames(frames))
    done = _published(agent)
    model_now = agent.slots["cls"].current
    threads = str(model_now.runner.describe().get("intra_op_threads", "0")) if model_now else "0"
    agent.stop()
    # "1 (auto: 2 runs side by side on 2 cores)": the number the session runs with comes first.
    intra_op = int(threads.split()[0]) if threads.split()[0].isdigit() else 0
    return {"fps": done / wall, "cpu_s_per_frame": cpu / done, "frames": done, "intra_op_threads": intra_op}


def case_results(
    model: Path, spec: PreprocessSpec, video: Path, limit: int = 300
) -> list[tuple[np.ndarray[Any, Any], ResultMessage]]:
    """Up to ``limit`` frames of the case with the result message the agent publishes for each
    (its backend, the slot's default postprocess, the message the publish stage builds)."""
    runner = get_backend("onnxruntime").load(model, LoadOptions(intra_op_threads=1))
    name = runner.inputs[0].name
    post = Postprocessor(ClassificationSpec())
    ref = ModelRef(slot="cls", model_id=model.stem, version="1", sha256="0" * 64)
    pairs = []
    for index, image in enumerate(_frames(video)[:limit]):
        tensor, letterbox = preprocess(image, spec)
        outputs = runner.infer({name: tensor[np.newaxis]})
        prediction = post({k: v[0] for k, v in outputs.items()}, letterbox)
        latency = {"preprocess": 0.1, "queue": 0.1, "infer": 0.5, "postprocess": 0.02, "total": 1.0}
        now = time.time()
        message = ResultMessage(
            stream="cam",
            frame_index=index,
            captured_at=now,
            published_at=now,
            model=ref,
            latency_ms=latency,
            classes=prediction.classes,
        )
        pairs.append((image, message))
    runner.close()
    return pairs


def _board_minute(
    images: list[np.ndarray[Any, Any]],
    messages: list[ResultMessage],
    fps: float,
    link: MqttLink | None,
) -> dict[str, float]:
    """Process CPU per frame of the board's per-frame calls over one simulated minute at ``fps``;
    with ``link``, a sampler at the default rate is on the board and its publisher thread runs."""
    board = SnapshotBoard()
    tick = [0.0]
    # Every frame under the bar, the default rate: the rate decides what is kept.
    config = SamplesConfig(enabled=True, max_confidence=1.0)
    sampler = Sampler(config, "cls", clock=lambda: tick[0])
    candidates = sum(sample_reason(m.classes, m.detections, config) is not None for m in messages)
    stop = threading.Event()
    publisher: SamplePublisher | None = None
    if link is not None:
        topic = "bench/sampling/up/samples"
        publisher = SamplePublisher(
            [sampler], partial(link.publish, topic, qos=1), partial(link.payload_limit, topic), stop
        )
        board.on_paired = sampler.offer
        publisher.start()
    step = 1.0 / fps
    c0 = time.process_time()
    for index, (image, message) in enumerate(zip(images, messages, strict=True)):
        board.inferred("cam", index, image)
        board.published(message)
        tick[0] += step
    if publisher is not None:
        # Inside the window: the kept frames' encode and publish, on the publisher's own thread.
        kept = candidates - sampler.skipped
        deadline = time.monotonic() + 30
        while publisher.published + publisher.dropped < kept and time.monotonic() < deadline:
            time.sleep(0.001)
    cpu = time.process_time() - c0
    stop.set()
    if publisher is not None:
        publisher.join(5)
    published = publisher.published if publisher is not None else 0
    return {"cpu_s_per_frame": cpu / len(messages), "samples_published": float(published)}


def _hook_test_s(board: SnapshotBoard, n: int) -> float:
    """Seconds per frame of the one line sampling-off leaves on the frame path: the board's test."""
    c0 = time.process_time()
    for _ in range(n):
        if board.on_paired is not None:
            raise AssertionError("sampling off wires no sampler")
    test = time.process_time() - c0
    c0 = time.process_time()
    for _ in range(n):
        pass
    empty = time.process_time() - c0
    return max(0.0, test - empty) / n


def bench_sampling_cost(
    pairs: list[tuple[np.ndarray[Any, Any], ResultMessage]],
    fps: float,
    agent_cpu_s_per_frame: float,
    link: MqttLink,
    repeat: int = 3,
) -> dict[str, float]:
    """The sampler's CPU per frame, on at its default rate and off (see the module docstring)."""
    frames = min(200_000, max(len(pairs), math.ceil(fps * 60.0)))
    images = [pairs[i % len(pairs)][0] for i in range(frames)]
    messages = [pairs[i % len(pairs)][1].model_copy(update={"frame_index": i}) for i in range(frames)]
    on, off = [], []
    for _ in range(repeat):
        off.append(_board_minute(images, messages, fps, None))
        on.append(_board_minute(images, messages, fps, link))
    on_cost = statistics.median(
        a["cpu_s_per_frame"] - b["cpu_s_per_frame"] for a, b in zip(on, off, strict=True)
    )
    off_cost = _hook_test_s(SnapshotBoard(), frames)
    return {
        "fps_simulated": fps,
        "frames_simulated": frames,
        "simulated_s": frames / fps,
        "samples_published": statistics.median(r["samples_published"] for r in on),
        "board_ms_per_frame_sampling_off": statistics.median(r["cpu_s_per_frame"] for r in off) * 1000,
        "on_cost_ms_per_frame": on_cost * 1000,
        "off_cost_ms_per_frame": off_cost * 1000,
        "sampling_on_cost_fraction": on_cost / agent_cpu_s_per_frame,
        "sampling_off_cost_fraction": off_cost / agent_cpu_s_per_frame,
    }


def bench_latency(
    model: Path, size: int, video: Path, port: int, workdir: Path, seconds: float
) -> dict[str, float]:
    """Capture-to-publish latency with the file paced at its own 30 fps."""
    path = _agent_config(workdir, port, model, size, video, loop=True, realtime=True)
    agent, _wall, _cpu = _run_agent(path, lambda _a: False, timeout=seconds)
    snap = agent.metrics.snapshot()
    agent.stop()
    return {
        "p50_ms": snap.get("stream.cam.latency.total.p50_ms", float("nan")),
        "p99_ms": snap.get("stream.cam.latency.total.p99_ms", float("nan")),
        "frames": snap.get("stream.cam.frames_published", 0.0),
    }


def bench_swap(
    model: Path, other: Path, size: int, video: Path, port: int, workdir: Path, frames: int
) -> dict[str, float]:
    """Largest gap between consecutive results while the slot hot-swaps at full rate."""
    observer = Observer(MqttSettings(host="127.0.0.1", port=port), ["fleet/v1/bench/up/results/cam"]).start()
    path = _agent_config(workdir, port, model, size, video, loop=False)
    swap_window: list[float] = []  # wall-clock start of the reload, end of the reload

    def until(agent: Agent) -> bool:
        if not swap_window and _published(agent) >= frames // 2:
            path.write_text(
                path.read_text().replace(str(model), str(other)).replace("version: '1'", "version: '2'")
            )
            swap_window.append(time.time())
            agent.reload()
            swap_window.append(time.time())
        return _published(agent) >= frames

    agent, _wall, _cpu = _run_agent(path, until, timeout=300)
    agent.stop()
    stamps: list[tuple[int, float, str]] = []
    while (arrival := observer.get(1.0)) is not None:
        payload = json.loads(arrival[1])
        stamps.append((payload["frame_index"], payload["published_at"], payload["model"]["version"]))
    observer.stop()
    stamps.sort()
    gaps = [b[1] - a[1] for a, b in itertools.pairwise(stamps)]
    # Gaps that end between the reload and 0.5 s after the first result of the new model (loading,
    # validating, the frames queued meanwhile), against every other gap of the run: the swap's cost.
    went_live = min((t for _i, t, v in stamps if v == "2"), default=swap_window[-1] if swap_window else 0.0)
    start, end = (swap_window[0], went_live + 0.5) if swap_window else (0.0, 0.0)
    during = [b[1] - a[1] for a, b in itertools.pairwise(stamps) if start <= b[1] <= end]
    steady = [b[1] - a[1] for a, b in itertools.pairwise(stamps) if not start <= b[1] <= end]
    versions = sorted({v for _i, _t, v in stamps})
    indices = [i for i, _t, _v in stamps]
    return {
        "results": len(stamps),
        "lost_frames": (max(indices) - min(indices) + 1 - len(set(indices))) if indices else -1,
        "versions_seen": len(versions),
        "median_gap_ms": statistics.median(gaps) * 1000 if gaps else float("nan"),
        "max_gap_ms": max(gaps) * 1000 if gaps else float("nan"),
        "mean_gap_ms": statistics.fmean(gaps) * 1000 if gaps else float("nan"),
        "max_gap_over_median": (max(gaps) / statistics.median(gaps)) if gaps else float("nan"),
        # Batches publish several results at once, so the median gap is tiny; the mean is the frame period.
        "max_gap_over_mean": (max(gaps) / statistics.fmean(gaps)) if gaps else float("nan"),
        "reload_to_first_new_result_s": (went_live - swap_window[0]) if swap_window else float("nan"),
        "max_gap_during_swap_ms": max(during) * 1000 if during else float("nan"),
        "max_gap_steady_ms": max(steady) * 1000 if steady else float("nan"),
        "swap_over_steady_max_gap": (max(during) / max(steady)) if during and steady else float("nan"),
    }


def main() -> int:
    # stdout carries the JSON report only; the agent's logs go to stderr, warnings and up.
    configure_logging("console", "warning", stream=sys.stderr)
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--frames", type=int, default=300, help="frames in the heavy case's 640x480 video")
    parser.add_argument(
        "--tiny-frames",
        type=int,
        default=1500,
        help="frames in the tiny case's video (it runs at ~1000 fps: 300 frames would be a 0.3 s run)",
    )
    parser.add_argument("--latency-seconds", type=float, default=8.0)
    parser.add_argument("--cases-only", action="store_true", help="skip the latency and hot-swap runs")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved runs per variant (median)")
    args = parser.parse_args()
    report: dict[str, Any] = {
        "frames": {"heavy": args.frames, "tiny": args.tiny_frames},
        "video": "640x480 MJPG",
        "cpu_count": __import__("os").cpu_count(),
    }
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        workdir = Path(tmp)
        video = write_demo_video(workdir / "bench.avi", frames=args.frames, fps=30.0)
        long_video = write_demo_video(workdir / "bench-long.avi", frames=args.tiny_frames, fps=30.0)
        with Broker(workdir / "broker") as broker:
            tiny, tiny_size, tiny_facts = tiny_matching_decode(workdir, long_video)
            report["tiny_model"] = tiny_facts
            heavy_model = write_mobilenet_like(workdir / "heavy.onnx", input_size=224)
            cases = {
                "heavy": (heavy_model, 224, video, args.frames),
                "tiny": (tiny, tiny_size, long_video, args.tiny_frames),
            }
            for case, (model, size, clip, frames) in cases.items():
                spec = PreprocessSpec(width=size, height=size)
                rows: dict[str, list[dict[str, float]]] = {
                    "raw": [],
                    "naive": [],
                    "agent": [],
                    "spin": [],
                    "decode": [],
                    "infer": [],
                    "preprocess": [],
                    "sampling": [],
                }
                # Interleaved repeats, medians compared: a burst of load elsewhere on the machine
                # then hits every variant alike instead of deciding a ratio.
                for rep in range(args.repeat):
                    rows["raw"].append(bench_raw(model, spec, clip))
                    rows["naive"].append(
                        bench_naive(model, spec, clip, broker.port, workdir / f"{case}-naive-{rep}")
                    )
                    rows["agent"].append(
                        bench_agent(model, size, clip, broker.port, workdir / f"{case}-agent-{rep}", frames)
                    )
                    # Decode and inference alone, right after the agent's run and as it ran them.
                    rows["decode"].append(bench_decode_cpu(clip))
                    threads = int(rows["agent"][-1]["intra_op_threads"])
                    rows["infer"].append(bench_agent_infer_cpu(model, spec, clip, threads))
                    rows["preprocess"].append(bench_preprocess_cpu(spec, clip))
                    # The same agent with ORT's thread spinning on (slot option allow_spinning), as
                    # the raw and naive loops have it by default: more throughput, CPU burnt idle.
                    rows["spin"].append(
                        bench_agent(
                            model,
                            size,
                            clip,
                            broker.port,
                            workdir / f"{case}-spin-{rep}",
                            frames,
                            {"allow_spinning": True},
                        )
                    )
                    # Samples for retraining on at its default rate, every frame under the bar: each
                    # paired frame pays the decision, two a minute the JPEG encode.
                    rows["sampling"].append(
                        bench_agent(
                            model,
                            size,
                            clip,
                            broker.port,
                            workdir / f"{case}-sampling-{rep}",
                            frames,
                            {"samples": {"enabled": True, "max_confidence": 1.0}},
                        )
                    )
                raw, naive, agent, spinning = (_median(rows[k]) for k in ("raw", "naive", "agent", "spin"))
                decode, infer = _median(rows["decode"]), _median(rows["infer"])
                pre = _median(rows["preprocess"])
                sampling = _median(rows["sampling"])
                sampler_link = _link(broker.port, workdir / f"{case}-sampling-cost", f"{case}-sampling")
                try:
                    sampling_cost = bench_sampling_cost(
                        case_results(model, spec, clip), agent["fps"], agent["cpu_s_per_frame"], sampler_link
                    )
                finally:
                    sampler_link.stop()
                overheads = [
                    overhead_ms_per_frame(a, d, i)
                    for a, d, i in zip(rows["agent"], rows["decode"], rows["infer"], strict=True)
                ]
                report[case] = {
                    "repeats": args.repeat,
                    # The agent's own CPU per frame beyond decode and inference, each measured in the
                    # same repeat (agent CPU - decode CPU - inference CPU as the agent runs it).
                    "overhead_ms_per_frame": statistics.median(overheads),
                    "overhead_ms_samples": [round(o, 3) for o in overheads],
                    "decode_cpu_ms_per_frame": decode["cpu_s_per_frame"] * 1000.0,
                    "infer_cpu_ms_per_frame": infer["cpu_s_per_frame"] * 1000.0,
                    # Preprocessing alone, the part of the overhead that grows with the input size.
                    "preprocess_cpu_ms_per_frame": pre["cpu_s_per_frame"] * 1000.0,
                    "raw_infer": raw,
                    "naive_loop": naive,
                    "agent": agent,
                    "agent_allow_spinning": spinning,
                    "agent_sampling_on": sampling,
                    "agent_sampling_on_fps_samples": [round(r["fps"], 1) for r in rows["sampling"]],
                    # The sampler's own cost, measured directly (module docstring): the figure to
                    # judge its target by; the end-to-end ratios below vary by more than it.
                    "sampling_cost": sampling_cost,
                    "sampling_on_cost_fraction": sampling_cost["sampling_on_cost_fraction"],
                    "sampling_off_cost_fraction": sampling_cost["sampling_off_cost_fraction"],
                    "sampling_on_over_off_fps_samples": [
                        round(s["fps"] / a["fps"], 3)
                        for s, a in zip(rows["sampling"], rows["agent"], strict=True)
                    ],
                    "sampling_on_over_off_cpu_samples": [
                        round(s["cpu_s_per_frame"] / a["cpu_s_per_frame"], 3)
                        for s, a in zip(rows["sampling"], rows["agent"], strict=True)
                    ],
                    "agent_fps_samples": [round(r["fps"], 1) for r in rows["agent"]],
                    "ratios": {
                        "agent_over_raw_fps": agent["fps"] / raw["fps"],
                        "agent_over_naive_fps": agent["fps"] / naive["fps"],
                        "agent_over_naive_cpu_per_frame": agent["cpu_s_per_frame"] / naive["cpu_s_per_frame"],
                        "sampling_on_over_off_fps": sampling["fps"] / agent["fps"],
                        "sampling_on_over_off_cpu_per_frame": sampling["cpu_s_per_frame"]
                        / agent["cpu_s_per_frame"],
                        "spinning_agent_over_raw_fps": spinning["fps"] / raw["fps"],
                        "spinning_agent_over_naive_fps": spinning["fps"] / naive["fps"],
                        "spinning_agent_over_naive_cpu_per_frame": spinning["cpu_s_per_frame"]
                        / naive["cpu_s_per_frame"],
                    },
                }
                print(f"{case}: done", file=sys.stderr)
            heavy, size, _clip, _frames = cases["heavy"]
            if args.cases_only:
                print(json.dumps(report, indent=2))
                return 0
            report["latency_30fps_heavy"] = bench_latency(
                heavy, size, video, broker.port, workdir / "latency", args.latency_seconds
            )
            other = write_mobilenet_like(workdir / "heavy-v2.onnx", input_size=224, seed=1)
            report["hot_swap_heavy"] = bench_swap(
                heavy, other, size, video, broker.port, workdir / "swap", args.frames
            )
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
