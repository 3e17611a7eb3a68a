"""``edge-agent demo``: the whole agent and the operator side on one machine, in about 30 seconds.

Starts a private mosquitto, writes a factory classifier, two versions of the shapes classifier, a
detector and a video of shapes, makes a signing key and trusts it in the agent's config, runs the
real daemon as a subprocess, and deploys classifier v1 and then v2 over MQTT with the same code as
``edge-agent fleet deploy`` (signed manifest, retained desired state, chunk pull), printing each job
state as it happens. Results and telemetry are printed as they arrive; at the end SIGTERM stops the
agent and the summary checks that the video stream lost no frame across the two hot-swaps.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agent.demo.broker import Broker
from agent.demo.modelzoo import write_detector
from agent.demo.setup import (
    DEVICE,
    PREFIX,
    DemoFiles,
    demo_config,
    demo_models,
    detector_v2,
    write_shapes_video,
)
from agent.fleet.cli.progress import passed_states, progress_line, state_line
from agent.fleet.deploy.keys import load_signing_key, write_keypair
from agent.fleet.deploy.outcome import DeviceProgress
from agent.fleet.deploy.plan import DeployPlan
from agent.fleet.deploy.run import FleetDeploy
from agent.logs.setup import configure_logging
from agent.mqtt.observer import Observer
from agent.mqtt.settings import MqttSettings
from agent.specs.postprocess import ClassificationSpec


@dataclass
class DemoLedger:
    """What the demo saw, to judge the run at the end."""

    indices: dict[str, list[int]] = field(default_factory=dict)
    versions: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    #: Lobby results per model version: (frames, frames whose top class is what the video shows).
    scored: dict[str, list[int]] = field(default_factory=dict)
    deploys: dict[str, DeviceProgress] = field(default_factory=dict)
    telemetry: int = 0
    offline_seen: bool = False

    def record(self, stream: str, index: int, version: str) -> None:
        self.indices.setdefault(stream, []).append(index)
        seen = self.versions.setdefault(stream, [])
        if not seen or seen[-1][1] != version:
            seen.append((index, version))

    def score(self, version: str, correct: bool) -> None:
        counts = self.scored.setdefault(version, [0, 0])
        counts[0] += 1
        counts[1] += int(correct)

    def gaps(self, stream: str) -> tuple[int, int]:
        """(frames missing, frames duplicated) between the first and last index seen."""
        got = self.indices.get(stream, [])
        if not got:
            return (0, 0)
        unique = set(got)
        return (max(got) - min(got) + 1 - len(unique), len(got) - len(unique))


def _describe(payload: dict[str, Any]) -> str:
    if payload.get("classes"):
        top = payload["classes"][0]
        return f"top: {top['label']} ({top['score']:.2f})"
    if payload.get("detections") is not None:
        dets = payload["detections"]
        first = f", e.g. {dets[0]['label']} {dets[0]['score']:.2f}" if dets else ""
        return f"{len(dets)} objects{first}"
    return "tensors"


def _print_telemetry(values: dict[str, Any]) -> None:
    parts = []
    for stream in ("lobby", "gate"):
        fps = values.get(f"stream.{stream}.fps")
        p50 = values.get(f"stream.{stream}.latency.total.p50_ms")
        p99 = values.get(f"stream.{stream}.latency.total.p99_ms")
        if fps is not None:
            parts.append(f"{stream} {fps:.1f} fps p50 {p50 or 0:.0f} ms p99 {p99 or 0:.0f} ms")
    cpu, rss = values.get("process.cpu_percent"), values.get("process.rss_mb")
    if cpu is not None and rss is not None:
        parts.append(f"cpu {cpu:.0f}% rss {rss:.0f} MB")
    print(f"  telemetry  {' | '.join(parts)}", flush=True)


@contextmanager
def demo_workdir(workdir: Path | None, *, keep: bool) -> Iterator[Path]:
    """The demo's directory: ``workdir`` (created, always kept: the user chose it) or a new temporary
    one, removed at exit unless ``keep`` (each run writes about 2.3 MB of models, video and state)."""
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
        print(f"edge-agent demo: files in {workdir}")
        yield workdir
        return
    made = Path(tempfile.mkdtemp(prefix="edge-agent-demo-"))
    if keep:
        print(f"edge-agent demo: files in {made} (kept: --keep)")
    else:
        print(f"edge-agent demo: files in {made} (removed at exit; --keep keeps them)")
    try:
        yield made
    finally:
        if not keep:
            shutil.rmtree(made, ignore_errors=True)


def run_demo(duration: float | None = 30.0, workdir: Path | None = None, *, keep: bool = False) -> int:
    """Run the demo; ``duration=None`` runs until Ctrl-C. Returns the exit code.

    Files go to ``workdir`` when given (kept), else to a temporary directory removed at the end
    unless ``keep``.
    """
    # The operator side runs in this process: only its warnings, the demo prints what happens.
    configure_logging("console", "warning")
    with demo_workdir(workdir, keep=keep) as where:
        return _run_demo_in(where, duration)


def _run_demo_in(workdir: Path, duration: float | None) -> int:
    models = demo_models(workdir)
    detector = write_detector(workdir / "detector.onnx", input_size=320, num_classes=3, seed=0)
    write_detector(detector_v2(workdir), input_size=320, num_classes=3, seed=1)
    hold = 8
    video, truth = write_shapes_video(workdir / "lobby.avi", hold=hold)
    which = (
        "the trained shapes classifier" if models.trained else "random-weight classifiers (no trained model)"
    )
    print(f"  wrote a factory classifier, v1 and v2 ({which}), a detector and a video of shapes")
    key = write_keypair(workdir / "keys", f"demo-{os.urandom(2).hex()}", overwrite=True)
    print(
        f"  demo: deploy manifests are signed with key id {key.key_id}, made for this run and trusted "
        "by the agent's delivery.trusted_keys"
    )

    with Broker(workdir / "broker") as broker:
        print(f"  mosquitto listening on 127.0.0.1:{broker.port}")
        files = DemoFiles(workdir, broker.port, models, detector, video, truth, hold, key)
        files.config_path.write_text(yaml.safe_dump(demo_config(files)))
        settings = MqttSettings(host="127.0.0.1", port=broker.port, prefix=PREFIX)
        observer = Observer(settings, [f"{PREFIX}/{DEVICE}/up/#"]).start()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        daemon = subprocess.Popen(
            [sys.executable, "-m", "agent", "run", "-c", str(files.config_path)], env=env
        )
        print(f"  started the agent daemon (pid {daemon.pid}) on the factory classifier\n")
        ledger = DemoLedger()
        try:
            _watch(observer, ledger, daemon, files, settings=settings, duration=duration)
        except KeyboardInterrupt:
            print("\n  Ctrl-C")
        finally:
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
            code = daemon.wait(timeout=20)
            _drain(observer, ledger, files, 2.0)
            observer.stop()
    return _verdict(ledger, code)


class _DemoDeploy:
    """One ``fleet deploy`` of the demo, polled from the demo's loop; prints each job state."""

    #: Slow enough to watch the download progress, fast enough for a 30 s demo.
    RATE_BPS = 256 * 1024

    def __init__(self, files: DemoFiles, settings: MqttSettings, model: Path, version: str, start: float):
        self.version = version
        self.start = start
        self._last: tuple[object, ...] | None = None
        self._shown = 0
        plan = DeployPlan(
            model=model,
            devices=(DEVICE,),
            slot="classifier",
            version=version,
            model_id="shapes-classifier",
            chunk_size=32 * 1024,
            postprocess=ClassificationSpec(labels=files.models.labels, top_k=3),
        )
        self.deploy = FleetDeploy(
            settings,
            plan,
            signing_key=load_signing_key(files.key.private),
            key_id=files.key.key_id,
            max_rate_bps=self.RATE_BPS,
            on_change=self._show,
        )
        manifest = self.deploy.manifest
        print(
            f"\n  >>> fleet deploy {model.name} as v{version}: job {manifest.job_id}, "
            f"{manifest.chunk_count} chunks, signed, retained on down/desired/classifier\n",
            flush=True,
        )
        self.deploy.start()
        self.done = False

    def _show(self, devices: list[DeviceProgress]) -> None:
        stamp = f"  [{time.monotonic() - self.start:5.1f}s] job v{self.version}"
        for p in devices:
            for state in passed_states(p, self._shown):
                print(f"{stamp}  {state_line(p, state)}", flush=True)
            self._shown = len(p.history)
            key = (p.state, int(p.fraction * 10))
            if key != self._last:
                self._last = key
                print(f"{stamp}  {progress_line(p)}", flush=True)

    def poll(self, ledger: DemoLedger) -> bool:
        """Handle news; True (once) when the job ended, then the deploy is stopped."""
        if self.done or not self.deploy.poll(0.0):
            return False
        self.done = True
        self.deploy.stop()
        ledger.deploys[f"v{self.version}"] = self.deploy.snapshot()[0]
        return True


def _watch(
    observer: Observer,
    ledger: DemoLedger,
    daemon: subprocess.Popen[bytes],
    files: DemoFiles,
    *,
    settings: MqttSettings,
    duration: float | None,
) -> None:
    start = time.monotonic()
    first_at = 1.0  # the manifest is retained: the agent gets it whenever it connects
    second_at = (duration or 30.0) * 0.45
    sighup_at = (duration or 30.0) * 0.75
    reloaded = False
    deploys: list[_DemoDeploy] = []
    last_print: dict[str, float] = {}
    try:
        while duration is None or time.monotonic() - start < duration:
            if daemon.poll() is not None:
                print(f"  the agent exited early with code {daemon.returncode}")
                return
            elapsed = time.monotonic() - start
            if not deploys and elapsed >= first_at:
                deploys.append(_DemoDeploy(files, settings, files.models.v1, "1", start))
            elif len(deploys) == 1 and deploys[0].done and elapsed >= second_at:
                deploys.append(_DemoDeploy(files, settings, files.models.v2, "2", start))
            if not reloaded and elapsed >= sighup_at:
                files.config_path.write_text(yaml.safe_dump(demo_config(files, detector_version="2")))
                daemon.send_signal(signal.SIGHUP)
                reloaded = True
                print(
                    "\n  >>> rewrote the config to detector v2 and sent SIGHUP (systemctl reload): "
                    "hot-swap\n",
                    flush=True,
                )
            for deploy in deploys:
                if deploy.poll(ledger):
                    print("", flush=True)
            _drain(observer, ledger, files, 0.2, last_print=last_print, start=start)
    finally:
        for deploy in deploys:
            if not deploy.done:
                deploy.deploy.stop()
                ledger.deploys[f"v{deploy.version}"] = deploy.deploy.snapshot()[0]


def _drain(
    observer: Observer,
    ledger: DemoLedger,
    files: DemoFiles,
    seconds: float,
    *,
    last_print: dict[str, float] | None = None,
    start: float = 0.0,
) -> None:
    until = time.monotonic() + seconds
    while (remaining := until - time.monotonic()) > 0:
        arrival = observer.get(remaining)
        if arrival is None:
            return
        topic, raw, _retained = arrival
        kind = topic.split("/up/", 1)[1]
        payload = json.loads(raw)
        if kind.startswith("results/"):
            stream = kind.split("/", 1)[1]
            version = payload["model"].get("version") or "-"
            ledger.record(stream, payload["frame_index"], version)
            truth = ""
            if stream == "lobby" and payload.get("classes"):
                shown = files.true_label(payload["frame_index"])
                ledger.score(version, payload["classes"][0]["label"] == shown)
                truth = f"  [video shows: {shown}]"
            if last_print is not None and time.monotonic() - last_print.get(stream, 0.0) > 1.0:
                last_print[stream] = time.monotonic()
                print(
                    f"  [{time.monotonic() - start:5.1f}s] {stream:<6} frame {payload['frame_index']:>5}  "
                    f"{payload['model']['model_id']} v{version}  {_describe(payload)}  "
                    f"{payload['latency_ms']['total']:.1f} ms{truth}",
                    flush=True,
                )
        elif kind == "telemetry":
            ledger.telemetry += 1
            _print_telemetry(payload)
        elif kind == "status":
            print(f"  status     {payload['state']} (session {payload['session']})", flush=True)
            ledger.offline_seen = payload["state"] == "offline"


def _verdict(ledger: DemoLedger, code: int) -> int:
    print("\n  summary")
    ok = code == 0
    print(f"    agent exit code          {code}")
    for name in ("v1", "v2"):
        progress = ledger.deploys.get(name)
        if progress is None:
            print(f"    deploy {name}                not started")
            ok = False
            continue
        states = " -> ".join(s.value for s in progress.history) or "no job state received"
        print(f"    deploy {name}                {states}")
        if not progress.ok:
            print(f"      {progress.error_code}: {progress.error}")
        ok = ok and progress.ok
    for stream, indices in sorted(ledger.indices.items()):
        missing, dupes = ledger.gaps(stream)
        print(f"    {stream:<6} results          {len(indices)} (frames {min(indices)}..{max(indices)})")
        history = " -> ".join(f"v{v} from frame {i}" for i, v in ledger.versions[stream])
        print(f"    {stream:<6} model versions   {history}")
        if stream == "lobby":
            print(f"    lobby frames lost        {missing} (duplicates {dupes})")
            ok = ok and missing == 0 and dupes == 0 and len(ledger.versions[stream]) >= 3
        if stream == "gate":
            swapped = [v for _i, v in ledger.versions[stream]] == ["1", "2"]
            print(f"    gate SIGHUP hot-swap     {'v1 -> v2' if swapped else 'did not happen'}")
            ok = ok and swapped
    for version, (frames, correct) in ledger.scored.items():
        share = 100.0 * correct / max(frames, 1)
        print(f"    lobby top-1 = video      v{version}: {correct}/{frames} ({share:.0f}%)")
    print(f"    telemetry messages       {ledger.telemetry}")
    print(f"    offline status at exit   {'yes' if ledger.offline_seen else 'no'}")
    ok = ok and bool(ledger.indices) and ledger.offline_seen
    print(f"\n  demo {'passed' if ok else 'FAILED'}")
    return 0 if ok else 1
