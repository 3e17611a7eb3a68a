"""Eight RTSP cameras on one device, in one run, as JSON.

Eight real RTSP cameras (gst-rtsp-server, H.264 over TCP, tests/camera/rtsp_camera.py) on loopback,
each frame carrying its number and the wall-clock millisecond the camera made it. Three phases of
``--seconds`` each, after a warm-up:

- ``decode``: the agent's URL source alone (eight :class:`VideoSource` threads, nothing else), its
  process CPU per frame, against eight ``ffmpeg -i URL -f null -`` on the same cameras at the same
  time (their CPU per frame from /proc over the same window, after both stream): ``ratio`` is
  agent / ffmpeg. The agent's frames are BGR, so its figure includes the YUV to BGR conversion
  ``-f null`` skips. ``capture_latency``: from the camera making a frame to the source yielding it.
- ``one_slot`` and ``two_slots``: the agent in this process, the eight streams into one slot
  (batched up to ``max_batch`` 8) and into two slots of four. Per stream: results per second,
  latency from the camera making the frame to the result's ``published_at`` (p50, p99; the burnt-in
  time, read at capture by a wrapper around the source that this bench adds), the agent's own part
  of it (``capture_to_publish``: the result's ``latency_ms.total``) and the longest time between two
  results. ``starved``: a stream's results per second below half of the streams' median.

The test camera's own pipeline (appsrc, x264 ``zerolatency``, payloader) holds a frame for about
two frame intervals before it leaves, as a real camera's encoder does: ``capture_latency`` includes it.

    .venv/bin/python bench/cameras.py [--seconds 20] [--width 640 --height 360 --fps 15]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from agent.app.root import Agent
from agent.camera import source as source_module
from agent.camera.frame import Frame
from agent.camera.source import VideoSource
from agent.camera.source_spec import UrlSourceSpec
from agent.config import load_config
from agent.demo.broker import Broker
from agent.demo.modelzoo import write_classifier
from agent.logs.setup import configure_logging
from agent.mqtt.inbound import InboundMessage
from agent.mqtt.service_client import ServiceClient
from agent.mqtt.settings import MqttSettings
from agent.protocol.messages import ResultMessage, decode

# The cameras are the tests' own (tests/camera/rtsp_camera.py); a bench runs as a script from bench/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.camera.rtsp_camera import BITS, RtspCamera

STREAMS = 8
FFMPEG_IN = ["ffmpeg", "-hide_banner", "-loglevel", "error", "-rtsp_transport", "tcp", "-i"]
FFMPEG_OUT = ["-f", "null", "-", "-progress", "pipe:1", "-stats_period", "0.2", "-nostats"]


def _made_s(image: np.ndarray[Any, Any], now_s: float) -> float:
    """The wall-clock second the camera made ``image`` (its second row of blocks, ms mod 2**32)."""
    height, width = image.shape[:2]
    block_w, block_h = width // BITS, max(8, height // 15)
    xs = np.arange(BITS) * block_w + block_w // 2
    bits = image[block_h + block_h // 2, xs, 1] > 128
    made_ms = int("".join("1" if b else "0" for b in bits), 2)
    now_ms = int(now_s * 1000)
    return float(now_ms - ((now_ms - made_ms) % 2**BITS)) / 1000.0


@contextmanager
def burnt_in_times() -> Iterator[dict[tuple[str, int], float]]:
    """While open, every VideoSource records (stream, frame index) -> the camera's making time."""
    made: dict[tuple[str, int], float] = {}
    original = VideoSource.frames

    def frames(self: VideoSource, stop: threading.Event) -> Generator[Frame, None, None]:
        for frame in original(self, stop):
            made[(frame.stream, frame.index)] = _made_s(frame.image, frame.captured_at)
            yield frame

    source_module.VideoSource.frames = frames  # type: ignore[method-assign]
    try:
        yield made
    finally:
        source_module.VideoSource.frames = original  # type: ignore[method-assign]


def _until(done: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise SystemExit(f"bench: no {what} within {timeout_s:g} s")
        time.sleep(0.1)


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def bench_agent_decode(urls: list[str], seconds: float) -> dict[str, float]:
    """Eight URL sources on threads, frames dropped at once: process CPU per frame."""
    stop = threading.Event()
    counts = [0] * len(urls)
    sources = [
        VideoSource(f"cam{i}", UrlSourceSpec.model_validate({"url": url})) for i, url in enumerate(urls)
    ]

    latencies: list[float] = []

    def consume(i: int) -> None:
        for frame in sources[i].frames(stop):
            counts[i] += 1
            latencies.append((frame.captured_at - _made_s(frame.image, frame.captured_at)) * 1000)

    threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(len(urls))]
    for t in threads:
        t.start()
    _until(lambda: min(counts) >= 2 * STREAMS, "every camera streaming to the sources")
    start_counts, c0, t0 = list(counts), time.process_time(), time.perf_counter()
    latencies.clear()
    time.sleep(seconds)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    frames = sum(counts) - sum(start_counts)
    stop.set()
    for t in threads:
        t.join(30)
    for s in sources:
        s.close()
    return {
        "frames": frames,
        "fps_per_stream": frames / wall / len(urls),
        "cpu_ms_per_frame": cpu * 1000 / max(frames, 1),
        "cpu_cores": cpu / wall,
        "capture_latency_p50_ms": round(_percentile(latencies, 50), 1),
        "capture_latency_p99_ms": round(_percentile(latencies, 99), 1),
    }


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_ffmpeg_decode(urls: list[str], seconds: float) -> dict[str, float]:
    """``ffmpeg -i URL -f null -`` on every camera at once: CPU per frame over a window after they
    stream (process start and the stream's probing left out, as they are for the agent)."""
    procs = [
        subprocess.Popen(
            [*FFMPEG_IN, url, *FFMPEG_OUT],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for url in urls
    ]
    frames = [0] * len(procs)

    def follow(i: int) -> None:
        stdout = procs[i].stdout
        assert stdout is not None
        for line in stdout:
            if line.startswith("frame="):
                frames[i] = int(line.split("=")[1])

    for i in range(len(procs)):
        threading.Thread(target=follow, args=(i,), daemon=True).start()
    try:
        _until(lambda: min(frames) >= 2 * STREAMS, "every camera streaming to ffmpeg")
        f0, c0, t0 = sum(frames), sum(_cpu_s(p.pid) for p in procs), time.perf_counter()
        time.sleep(seconds)
        f1, c1, wall = sum(frames), sum(_cpu_s(p.pid) for p in procs), time.perf_counter() - t0
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(30)
    return {
        "frames": f1 - f0,
        "fps_per_stream": (f1 - f0) / wall / len(urls),
        "cpu_ms_per_frame": (c1 - c0) * 1000 / max(f1 - f0, 1),
        "cpu_cores": (c1 - c0) / wall,
    }


def _config(workdir: Path, port: int, model: Path, urls: list[str], slots: int) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    slot_names = [f"slot{k}" for k in range(slots)]
    config: dict[str, Any] = {
        "device_id": "bench",
        "state_dir": str(workdir / "state"),
        "mqtt": {"host": "127.0.0.1", "port": port},
        "slots": {
            name: {
                "model": str(model),
                "model_id": name,
                "version": "1",
                "preprocess": {"width": 64, "height": 64},
                "max_batch": STREAMS // slots,
            }
            for name in slot_names
        },
        "streams": {
            f"cam{i}": {
                "source": {"type": "url", "url": url},
                "slot": slot_names[i % slots],
                "drop_policy": "keep_newest",
            }
            for i, url in enumerate(urls)
        },
        "telemetry": {"interval_s": 60},
        "logging": {"format": "json", "level": "error"},
    }
    path = workdir / f"agent-{slots}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def bench_agent(
    workdir: Path, broker: Broker, model: Path, urls: list[str], slots: int, seconds: float
) -> dict[str, Any]:
    """The agent with eight streams into ``slots`` slots: results/s, latency and gaps per stream."""
    received: dict[str, list[ResultMessage]] = defaultdict(list)
    lock = threading.Lock()
    window = threading.Event()

    seen: set[str] = set()

    def on_result(message: InboundMessage) -> None:
        result = decode(ResultMessage, message.payload)
        with lock:
            seen.add(result.stream)
            if window.is_set():
                received[result.stream].append(result)

    client = ServiceClient(MqttSettings(host="127.0.0.1", port=broker.port), handler=on_result).start()
    client.subscribe("fleet/v1/bench/up/results/#", qos=0)
    path = _config(workdir, broker.port, model, urls, slots)
    with burnt_in_times() as made:
        agent = Agent(load_config(path), path)
        agent.start()
        _until(lambda: len(seen) == len(urls), "a result from every stream")
        time.sleep(2.0)  # the backlog of the start is gone
        window.set()
        c0, t0 = time.process_time(), time.perf_counter()
        time.sleep(seconds)
        window.clear()
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        agent.stop()
    client.stop()
    per_stream: dict[str, dict[str, float]] = {}
    for i in range(len(urls)):
        name = f"cam{i}"
        with lock:
            results = sorted(received[name], key=lambda r: r.published_at)
        latencies = [
            (r.published_at - made[(name, r.frame_index)]) * 1000
            for r in results
            if (name, r.frame_index) in made
        ]
        agent_part = [r.latency_ms.get("total", float("nan")) for r in results]
        times = [r.published_at for r in results]
        per_stream[name] = {
            "results_per_s": len(results) / wall,
            "latency_p50_ms": round(_percentile(latencies, 50), 1),
            "latency_p99_ms": round(_percentile(latencies, 99), 1),
            "capture_to_publish_p50_ms": round(_percentile(agent_part, 50), 1),
            "capture_to_publish_p99_ms": round(_percentile(agent_part, 99), 1),
            "longest_gap_s": round(max((b - a for a, b in itertools.pairwise(times)), default=0.0), 3),
        }
    rates = [s["results_per_s"] for s in per_stream.values()]
    median_rate = statistics.median(rates)
    all_latencies = [s["latency_p99_ms"] for s in per_stream.values()]
    return {
        "slots": slots,
        "per_stream": per_stream,
        "results_per_s_min": round(min(rates), 2),
        "results_per_s_max": round(max(rates), 2),
        "latency_p50_ms_median": round(
            statistics.median(s["latency_p50_ms"] for s in per_stream.values()), 1
        ),
        "latency_p99_ms_max": round(max(all_latencies), 1),
        "capture_to_publish_p99_ms_max": max(s["capture_to_publish_p99_ms"] for s in per_stream.values()),
        "starved": any(r < median_rate / 2 for r in rates),
        "cpu_cores": round(cpu / wall, 3),
    }


def main() -> int:
    configure_logging("console", "warning", stream=sys.stderr)
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=20.0, help="measured window of each phase")
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--height", type=int, default=360)
    parser.add_argument("--fps", type=int, default=15)
    args = parser.parse_args()
    report: dict[str, Any] = {
        "streams": STREAMS,
        "camera": f"H.264 {args.width}x{args.height} {args.fps} fps, RTSP/TCP, gst-rtsp-server on loopback",
        "cpu_count": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
    }
    cameras = [
        RtspCamera(width=args.width, height=args.height, fps=args.fps, gop=2 * args.fps, protocols="tcp")
        for _ in range(STREAMS)
    ]
    try:
        for camera in cameras:
            camera.start()
        urls = [c.url for c in cameras]
        agent_decode = bench_agent_decode(urls, args.seconds)
        ffmpeg_decode = bench_ffmpeg_decode(urls, args.seconds)
        report["decode"] = {
            "agent": agent_decode,
            "ffmpeg": ffmpeg_decode,
            "ratio": round(agent_decode["cpu_ms_per_frame"] / ffmpeg_decode["cpu_ms_per_frame"], 2),
        }
        with tempfile.TemporaryDirectory(prefix="bench-cameras-") as tmp:
            workdir = Path(tmp)
            model = write_classifier(workdir / "cls.onnx", input_size=64, num_classes=4)
            with Broker(workdir / "broker") as broker:
                report["one_slot"] = bench_agent(workdir / "one", broker, model, urls, 1, args.seconds)
                report["two_slots"] = bench_agent(workdir / "two", broker, model, urls, 2, args.seconds)
    finally:
        for camera in cameras:
            camera.stop()
    report["loadavg_end"] = os.getloadavg()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
