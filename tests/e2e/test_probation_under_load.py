"""End to end: a busy machine does not fail a healthy model in probation; a slow model still fails.

Real mosquitto, real ``python -m agent run`` daemons fed by a real HTTP MJPEG camera on loopback,
models deployed with the real FleetDeploy and judged with the bars operators run (``ProbationSpec()``:
latency 3x, fps 0.8, drops +0.1, class shift 0.5). The load is real too: two busy Python processes
per core, started once the probation began and killed when the job ended. The serving model is the
test classifier plus two ``[192, 192]`` matrix products (about 0.2-0.4 ms a frame), so the models
compared cost more than the call around them. The slot leaves the intra-op threads to the agent
(one for a model under 1.5 ms a frame, ONNX Runtime's pool above); the slower model is also tried
with a pool of two for both models, whose pairs run on one-thread copies (docs/protocol.md, "What a
pair holds").

Each test prints one JSON line (``probation-under-load``: the verdict, the figures and the load
average at the end): docs/benchmarks.md, "Probation under a CPU hog".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.demo.modelzoo import write_classifier
from agent.protocol.messages import JobState, JobStatus, ProbationFigures, decode
from agent.protocol.proving import ProbationSpec
from agent.protocol.topics import Topics
from tests.camera.mjpeg_server import MjpegServer
from tests.e2e.fleet_rig import Fleet, count_version, final_status, finish
from tests.mqtt_probe import Probe, Received
from tests.runtime.models import (
    write_copy,
    write_nan_when_bright,
    write_slower,
    write_slower_when_bright,
    write_swapped_classes,
)
from tests.waiting import patient

#: Alone: the hog is this test's load; beside other tests it would be theirs too.
pytestmark = [pytest.mark.slow, pytest.mark.alone]

#: Grey levels of the camera's frames: below and above the late-slow model's threshold (0.5 of 255);
#: the serving classifier names the same class on both, so only the cost changes with the scene.
DARK, BRIGHT = 40, 160


class CpuHog:
    """Processes that spin in Python: the load other work puts on a device (other containers, a
    second camera's decoding), competing with the agent's threads for the cores."""

    def __init__(self, processes: int) -> None:
        self.processes = processes
        self._running: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        for _ in range(self.processes):
            self._running.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))

    def stop(self) -> None:
        for proc in self._running:
            proc.kill()
        for proc in self._running:
            proc.wait(patient(10))
        self._running.clear()


@pytest.fixture
def hog() -> Iterator[CpuHog]:
    running = CpuHog(2 * (os.cpu_count() or 2))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def camera() -> Iterator[MjpegServer]:
    server = MjpegServer(width=64, height=48, fps=30.0)
    server.level = DARK
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def v1(tmp_path: Path) -> Path:
    """The e2e daemons' test classifier (tests/e2e/daemon.py)."""
    return write_classifier(tmp_path / "v1.onnx", input_size=32, num_classes=4, seed=1)


@pytest.fixture
def incumbent(v1: Path) -> Path:
    return write_slower(v1, v1.with_name("incumbent.onnx"), dim=192, repeats=2)


def serving(
    fleet: Fleet, device_id: str, probe: Probe, camera: MjpegServer, model: Path, threads: int = 0
) -> Topics:
    """A daemon serving ``model`` as version 1 on ``camera``, trusting the test's key, its slot's
    ``intra_op_threads`` set to ``threads`` (0: the agent's choice)."""
    files = fleet.files(device_id)
    source = {"type": "url", "url": camera.url, "reconnect_min_s": 0.2, "reconnect_max_s": 1.0}
    trust = {"trusted_keys": {fleet.keys.key_id: str(fleet.keys.public)}}
    files.write_config(
        model=model, stream={"source": source}, slot={"intra_op_threads": threads}, delivery=trust
    )
    fleet.start(files)
    topic = Topics("fleet/v1", device_id)
    probe.wait_for(count_version("1", topic.results("cam")), timeout=60)
    return topic


def in_probation(topic: Topics, job_id: str) -> Any:
    def seen(messages: list[Received]) -> bool:
        return any(
            m.topic == topic.jobs(job_id) and decode(JobStatus, m.payload).state is JobState.PROBATION
            for m in messages
        )

    return seen


def probation_elapsed(topic: Topics, at_least_s: float) -> Any:
    """The device's telemetry says its probation has run ``at_least_s`` seconds."""

    def seen(messages: list[Received]) -> bool:
        for m in messages:
            if m.topic == topic.telemetry:
                elapsed = json.loads(m.payload).get("slot.cls.probation.elapsed_s")
                if elapsed is not None and elapsed >= at_least_s:
                    return True
        return False

    return seen


def report(case: str, final: JobStatus, hog: CpuHog) -> dict[str, Any]:
    """The verdict as the operator sees it, printed as one JSON line with the load average."""
    probation = final.probation
    line = {
        "bench": "probation-under-load",
        "case": case,
        "state": final.state.value,
        "error_code": final.error_code,
        "failed": probation.failed.model_dump() if probation is not None and probation.failed else None,
        "current": probation.current if probation is not None else None,
        "baseline": probation.baseline if probation is not None else None,
        "hog_processes": hog.processes,
        "cpu_count": os.cpu_count(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(line))
    return line


@dataclass(frozen=True)
class Verdict:
    """How a probation ended: the deploy's view, the device's last status and the printed line."""

    state: JobState | None
    error_code: str | None
    probation: ProbationFigures
    line: dict[str, Any]

    @property
    def failed(self) -> tuple[str, float, float] | None:
        failed = self.probation.failed
        return None if failed is None else (failed.figure, failed.value, failed.bar)


@dataclass(frozen=True)
class Device:
    """A serving daemon of one test, its camera and the hog beside it."""

    fleet: Fleet
    device_id: str
    probe: Probe
    topic: Topics
    hog: CpuHog

    def probation(
        self,
        model: Path,
        case: str,
        *,
        probation_s: float,
        hog_first: bool = False,
        then: Callable[[], None] | None = None,
    ) -> Verdict:
        """Deploy ``model`` with the default probation bars; the hog starts once the probation began
        (``hog_first``: before the deploy), then ``then`` runs; the hog stops when the job ended."""
        if hog_first:
            self.hog.start()
        job = self.fleet.deploy(
            model, [self.device_id], "2", probation_s=probation_s, probation=ProbationSpec()
        )
        self.probe.wait_for(in_probation(self.topic, job.job_id), timeout=90)
        if not hog_first:
            self.hog.start()
        if then is not None:
            then()
        outcome = finish(job, timeout=probation_s + 90.0)
        final = final_status(self.probe, job.job_id, self.device_id)
        line = report(case, final, self.hog)
        self.hog.stop()
        progress = outcome.devices[self.device_id]
        assert final.probation is not None, line
        return Verdict(progress.state, progress.error_code, final.probation, line)


@pytest.fixture
def threads() -> int:
    """The slot's ``intra_op_threads``: the agent's choice unless a test says otherwise."""
    return 0


@pytest.fixture
def device(
    fleet: Fleet,
    device_id: str,
    probe: Probe,
    camera: MjpegServer,
    incumbent: Path,
    hog: CpuHog,
    threads: int,
) -> Device:
    """A daemon serving the incumbent as version 1 on the test's camera."""
    topic = serving(fleet, device_id, probe, camera, incumbent, threads)
    return Device(fleet, device_id, probe, topic, hog)


def test_a_cpu_hog_started_in_probation_does_not_roll_back_a_healthy_model_with_default_bars(
    device: Device, incumbent: Path
) -> None:
    same = write_copy(incumbent, incumbent.with_name("same.onnx"))

    verdict = device.probation(same, "healthy model, 20 s probation, hog from its start", probation_s=20.0)

    assert (verdict.state, verdict.error_code) == (JobState.ACTIVE, None), verdict.line
    assert verdict.probation.current["latency_pairs"] >= 10  # the latency was judged, on pairs
    assert verdict.probation.current["latency_ratio"] <= 3.0


@pytest.mark.parametrize("threads", [0, 2], ids=["threads-auto", "threads-2"])
def test_a_model_four_times_slower_is_still_rolled_back_under_the_hog(
    device: Device, v1: Path, incumbent: Path, threads: int
) -> None:
    """Eighteen matrix products where the serving model has two: about four times its CPU time in
    the daemon under the hog. Alone and with warm caches it is six to seven times as costly, but
    each call in the daemon also pays a fixed part (the call itself, caches the hog emptied) that
    both models pay alike, and which weighs more on a CPU that multiplies faster. With a pool of
    two threads each model serves on its pool, and its pairs run on a one-thread copy."""
    slower = write_slower(v1, incumbent.with_name("slower.onnx"), dim=192, repeats=18)

    case = f"model 4x slower, 20 s probation, hog from its start, intra_op_threads {threads or 'auto'}"
    verdict = device.probation(slower, case, probation_s=20.0)

    assert (verdict.state, verdict.error_code) == (JobState.ROLLED_BACK, "unhealthy"), verdict.line
    assert verdict.failed is not None
    figure, value, bar = verdict.failed
    assert (figure, bar) == ("p99_ratio", 3.0), verdict.line
    assert value > 3.0


def test_a_model_that_turns_slow_after_20_s_of_probation_is_rolled_back_under_the_hog(
    device: Device, camera: MjpegServer, incumbent: Path
) -> None:
    """The candidate is the serving model plus sixteen matrix products that run only on bright frames
    (an ONNX ``If``): as fast as the serving model while the scene is dark, some 4x slower once the
    camera turns bright, which it does once the device reports 20 s of probation. Nothing in the
    agent is told to slow it: the model's cost follows what the camera sees."""
    late = write_slower_when_bright(incumbent, incumbent.with_name("late.onnx"), repeats=16)

    def bright_after_20_s() -> None:
        device.probe.wait_for(probation_elapsed(device.topic, 20.0), timeout=60)
        camera.level = BRIGHT

    verdict = device.probation(
        late,
        "model 4x slower after 20 s of a 60 s probation, hog from its start",
        probation_s=60.0,
        then=bright_after_20_s,
    )

    assert (verdict.state, verdict.error_code) == (JobState.ROLLED_BACK, "unhealthy"), verdict.line
    assert verdict.failed is not None
    assert verdict.failed[0] == "p99_ratio", verdict.line
    assert verdict.probation.elapsed_s >= 60.0  # judged at the end, on the whole probation
    assert verdict.probation.current["class_shift"] == 0.0  # the same answers: only the cost changed


@pytest.mark.parametrize(
    ("bad", "figure"),
    [("swapped", "class_shift"), ("nan", "nan_outputs")],
    ids=["class-shift", "nan"],
)
def test_a_class_shifted_or_nan_model_keeps_its_verdict_under_the_hog(
    device: Device, camera: MjpegServer, incumbent: Path, bad: str, figure: str
) -> None:
    """As fast as the serving model, wrong in what it says: the load changes nothing of the verdict.
    The hog starts before the deploy here: a NaN fails at the first check after the scene turns
    bright (its trigger; dark, it passes validation), sooner than a hog started then would run.
    The class-swapped model is wrong on every frame."""
    writer = write_swapped_classes if bad == "swapped" else write_nan_when_bright
    model = writer(incumbent, incumbent.with_name(f"{bad}.onnx"))

    def bright() -> None:
        camera.level = BRIGHT

    verdict = device.probation(
        model, f"{figure} model, hog from before the deploy", probation_s=20.0, hog_first=True, then=bright
    )

    assert (verdict.state, verdict.error_code) == (JobState.ROLLED_BACK, "unhealthy"), verdict.line
    assert verdict.failed is not None
    assert verdict.failed[0] == figure, verdict.line
