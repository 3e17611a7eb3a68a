"""Model transfer benchmark: the chunk pull protocol vs raw QoS 1 publishing, and resume after a kill.

A 64 MB random model over a local mosquitto, for each chunk size (256 KiB and 1 MiB):

* ``raw_qos1_mb_s``: one client publishes every chunk at QoS 1 to a topic, another receives them;
  time until the last byte arrived. The ceiling: no requests, no verification, no disk.
* ``pull_mb_s``: the device (MqttLink + fetch_model: window, per-chunk SHA-256, .part + bitmap with
  fsync) pulls from a ChunkServer. ``ratio`` = pull / raw (target >= 0.6). The whole file's SHA-256
  is checked where the file is adopted (the store), which this does not measure.
* ``kill_at_50pct``: a device process pulls until half the model was served, is SIGKILLed,
  and a new one resumes over the same partial directory; ``refetched_bytes`` is what the server
  sent beyond the model size (bound: one window of chunks).

Raw and pull runs alternate (``--repeat`` times each after one warm-up run of both, same broker,
same chunk size, same publishing client settings) and the medians are compared, so a burst of load
from elsewhere on the machine does not decide the ratio. Each run's CPU seconds are counted too
(``raw_cpu_s``, ``pull_cpu_s``: receiving process, operator child and broker, medians): on a
machine shared with other work they say more than the speeds, and ``cpu_ratio`` is raw over pull.
``pull_flush_ms`` is what the device's flushes took in a pull (median; ``PullStats.flush_ms``): the
time written chunks held their window slots waiting to become durable. ``pull_page_faults``: the
minor page faults of the device's process during a pull (median).
The operator side (publisher, chunk server) runs in a child process, as it would on another host.
With ``--process agent`` (the default) every process of the bench makes the settings every
edge-agent process makes (the allocator's thresholds, agent/machine/process.py), and this one, where
the device and the raw subscriber run, the device agent's GIL switch interval too: raw and pull
sides alike; ``--process python`` keeps the interpreter's and glibc's defaults. Medians of 9 by
default: on shared cores single raw runs vary widely (docs/benchmarks.md, "Delivery").

``--fsync-delay-ms`` adds a delay to every fdatasync of the device, emulating a slow disk (an SD
card, a busy VM disk) on a fast one.

    .venv/bin/python bench/transfer.py [--size-mb 64] [--window 32] [--repeat 9]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from agent.delivery.settings import DeliveryConfig
from agent.delivery.transfer.pull import PullStats, fetch_model
from agent.demo.broker import Broker
from agent.fleet.chunks.server import DEFAULT_MAX_INFLIGHT, ChunkServer
from agent.logs.setup import configure_logging
from agent.machine.process import keep_freed_buffers, shorten_gil_switch
from agent.mqtt.inbound import InboundMessage
from agent.mqtt.link import MqttLink
from agent.mqtt.service_client import ServiceClient
from agent.mqtt.settings import MqttSettings
from agent.protocol.manifest import DeployManifest, build_manifest
from agent.protocol.topics import Topics
from agent.spool.queue import Spool

MIB = 1024 * 1024
#: How the children learn ``--process``.
_PROCESS_VAR = "BENCH_TRANSFER_PROCESS"


def _quiet_logs() -> None:
    """Warnings and errors only, on stderr: stdout carries the JSON result and the child protocol."""
    configure_logging("console", "warning", stream=sys.stderr)


def _settings(port: int, prefix: str) -> MqttSettings:
    return MqttSettings(
        host="127.0.0.1",
        port=port,
        prefix=prefix,
        max_payload_bytes=4 * MIB,
        reconnect_min_s=0.05,
        reconnect_max_s=0.5,
    )


# -- child process: the operator side -----------------------------------------------------------


def _child_raw(port: int, topic: str, model: Path, chunk_size: int, max_inflight: int) -> None:
    """Publish the model in chunks at QoS 1 on each ``go``; print ``done`` when all are acked."""
    client = ServiceClient(
        _settings(port, "bench"),
        client_id=f"raw-pub-{uuid.uuid4().hex[:6]}",
        max_inflight=max_inflight,  # the chunk server's publishing window
    ).start()
    data = model.read_bytes()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        for offset in range(0, len(data), chunk_size):
            client.publish(topic, data[offset : offset + chunk_size], qos=1)
        client.wait_published(120.0)
        print("done", flush=True)
    client.stop()


def _child_server(port: int, prefix: str, model: Path, manifest_file: Path, max_inflight: int) -> None:
    """Run a ChunkServer; answer ``stats`` lines with JSON; exit on ``quit``."""
    manifest = DeployManifest.model_validate_json(manifest_file.read_text())
    server = ChunkServer(_settings(port, prefix), group="bench", max_inflight=max_inflight)
    server.register(manifest, model, verify=False)
    server.start()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        print(json.dumps(server.stats()), flush=True)
    server.stop()


def _child_pull(argv: list[str]) -> None:
    """A device process that pulls until it is killed (the kill-at-50% case)."""
    port, prefix, device, state_dir, manifest_file, window, fsync_delay_ms = argv
    _slow_fsync(float(fsync_delay_ms))
    manifest = DeployManifest.model_validate_json(Path(manifest_file).read_text())
    dev = _Device(int(port), prefix, device, Path(state_dir))
    dev.fetch(manifest, int(window))
    dev.close()


def _slow_fsync(delay_ms: float) -> None:
    """Emulate a slow disk: every fdatasync of this process takes ``delay_ms`` longer."""
    if delay_ms <= 0:
        return
    real = os.fdatasync

    def fdatasync(fd: Any) -> None:
        real(fd)
        time.sleep(delay_ms / 1000)

    os.fdatasync = fdatasync


# -- device side ---------------------------------------------------------------------------------


class _Device:
    def __init__(self, port: int, prefix: str, device_id: str, state_dir: Path) -> None:
        self.topics = Topics(prefix, device_id)
        self.part_dir = state_dir / "partial"
        self.pulls: list[PullStats] = []
        self.spool = Spool(state_dir / "spool.sqlite")
        self.link = MqttLink(
            _settings(port, prefix),
            client_id=device_id,
            status_topic=self.topics.status,
            agent_version="bench",
            spool=self.spool,
        )
        self.link.start()
        if not self.link.wait_connected(10):
            raise RuntimeError("device link did not connect")

    def fetch(self, manifest: DeployManifest, window: int) -> Path:
        config = DeliveryConfig(chunk_window=window, chunk_timeout_s=5.0, job_deadline_s=600.0)
        return fetch_model(
            manifest,
            self.part_dir,
            lambda done, total: None,
            threading.Event(),
            link=self.link,
            topics=self.topics,
            config=config,
            on_pull=self.pulls.append,
        )

    def close(self) -> None:
        self.link.stop(timeout=1.0)
        self.spool.close()


class _Child:
    """A child process of this script, talking in lines on stdin/stdout."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def say(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def hear(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"child {self.proc.args!r} exited with {self.proc.wait()}")
        return line.strip()

    def served(self) -> int:
        self.say("stats")
        stats: dict[str, int] = json.loads(self.hear())
        return stats["served_bytes"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.say("quit")
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)


# -- measurements --------------------------------------------------------------------------------


class _RawCase:
    """A publisher child and a subscriber for raw QoS 1 runs of one model in one chunk size."""

    def __init__(self, port: int, model: Path, chunk_size: int, max_inflight: int) -> None:
        self.size = model.stat().st_size
        topic = f"bench/raw/{uuid.uuid4().hex[:8]}"
        self._received = 0
        self._all_in = threading.Event()
        self.sub = ServiceClient(_settings(port, "bench"), handler=self._on_message).start()
        self.sub.subscribe(topic, qos=1)
        self.pub = _Child("raw", str(port), topic, str(model), str(chunk_size), str(max_inflight))
        if self.pub.hear() != "ready":
            raise RuntimeError("raw publisher did not start")

    def _on_message(self, message: InboundMessage) -> None:
        self._received += len(message.payload)
        if self._received >= self.size:
            self._all_in.set()

    def speed(self) -> float:
        """MB/s of QoS 1 publishing the model's chunks from one client to another (subscribed at QoS 1)."""
        self._received = 0
        self._all_in.clear()
        started = time.perf_counter()
        self.pub.say("go")
        if not self._all_in.wait(300):
            raise RuntimeError(f"raw: only {self._received} of {self.size} bytes arrived")
        seconds = time.perf_counter() - started
        if self.pub.hear() != "done":
            raise RuntimeError("raw publisher failed")
        return self.size / MIB / seconds

    def close(self) -> None:
        self.pub.close()
        self.sub.stop()


class _PullCase:
    """One chunk server child for a model; pull cases (one per window) run against it."""

    def __init__(
        self, port: int, model: Path, manifest_file: Path, manifest: DeployManifest, max_inflight: int
    ) -> None:
        self.port = port
        self.manifest = manifest
        self.manifest_file = manifest_file
        self.prefix = f"bench{uuid.uuid4().hex[:6]}/v1"
        self.work = Path(tempfile.mkdtemp(prefix="bench-transfer-"))
        self.server = _Child(
            "serve", str(port), self.prefix, str(model), str(manifest_file), str(max_inflight)
        )
        if self.server.hear() != "ready":
            raise RuntimeError("chunk server did not start")

    def speed(self, window: int) -> dict[str, Any]:
        """Pull throughput of a fresh device."""
        base = self.server.served()
        device = f"dev-{uuid.uuid4().hex[:6]}"
        dev = _Device(self.port, self.prefix, device, self.work / device)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        started = time.perf_counter()
        path = dev.fetch(self.manifest, window)
        seconds = time.perf_counter() - started
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        dev.close()
        verified = os.path.getsize(path) == self.manifest.size
        path.unlink()
        return {
            "pull_mb_s": round(self.manifest.size / MIB / seconds, 1),
            "pull_seconds": round(seconds, 3),
            "flush_ms": sum(stats.flush_ms for stats in dev.pulls),
            "page_faults": faults,
            "served_bytes": self.server.served() - base,
            "verified": verified,
        }

    def kill_and_resume(self, window: int, fsync_delay_ms: float) -> dict[str, Any]:
        """SIGKILL a pulling device process at 50% served; resume; bytes served beyond the size."""
        base = self.server.served()
        device = f"dev-{uuid.uuid4().hex[:6]}"
        state = self.work / device
        args = [str(self.port), self.prefix, device, str(state), str(self.manifest_file), str(window)]
        child = _Child("pull", *args, str(fsync_delay_ms))
        try:
            while self.server.served() - base < self.manifest.size // 2:
                if child.proc.poll() is not None:
                    raise RuntimeError("pulling child ended before it was killed")
                time.sleep(0.002)
            os.kill(child.proc.pid, signal.SIGKILL)
        finally:
            child.proc.kill()
            child.proc.wait(10)
        time.sleep(0.2)  # replies already on their way to the dead process are counted too
        at_kill = self.server.served() - base
        dev = _Device(self.port, self.prefix, device, state)
        path = dev.fetch(self.manifest, window)
        dev.close()
        return {
            "killed_at_fraction": round(at_kill / self.manifest.size, 3),
            "refetched_bytes": self.server.served() - base - self.manifest.size,
            "window_bytes": window * self.manifest.chunk_size,
            "resumed_verified": os.path.getsize(path) == self.manifest.size,
        }

    def close(self) -> None:
        self.server.close()


def _cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) of process ``pid`` so far; this process when None."""
    if pid is None:
        times = os.times()
        return times.user + times.system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _CpuMeter:
    """CPU seconds one run costs this process, an operator child and the broker together."""

    def __init__(self, *pids: int | None) -> None:
        self.pids = (None, *pids)

    def run(self, measure: Any) -> tuple[Any, float]:
        before = sum(_cpu_s(pid) for pid in self.pids)
        result = measure()
        return result, sum(_cpu_s(pid) for pid in self.pids) - before


def _median(samples: list[float]) -> float:
    return round(statistics.median(samples), 1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mb", type=int, default=64)
    parser.add_argument("--window", type=int, nargs="+", default=[DeliveryConfig().chunk_window])
    parser.add_argument("--chunk-kib", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--repeat", type=int, default=9, help="raw and pull runs per case (medians)")
    parser.add_argument("--fsync-delay-ms", type=float, default=0.0, help="emulate a slow device disk")
    parser.add_argument(
        "--broker-inflight", type=int, default=None, help="mosquitto max_inflight_messages (default 20)"
    )
    parser.add_argument(
        "--publisher-inflight",
        type=int,
        default=DEFAULT_MAX_INFLIGHT,
        help="paho max_inflight of the chunk server and of the raw publisher alike",
    )
    parser.add_argument(
        "--process",
        choices=("agent", "python"),
        default="agent",
        help="agent: every process with the settings edge-agent makes (agent/machine/process.py); "
        "python: the interpreter's and glibc's defaults",
    )
    args = parser.parse_args()
    os.environ[_PROCESS_VAR] = args.process  # for the children
    if args.process == "agent":
        # The device and the raw subscriber beside it, as the device agent runs.
        keep_freed_buffers()
        shorten_gil_switch()

    _slow_fsync(args.fsync_delay_ms)
    workdir = Path(tempfile.mkdtemp(prefix="bench-transfer-broker-"))
    broker_config = ["set_tcp_nodelay true"]
    if args.broker_inflight is not None:
        broker_config.append(f"max_inflight_messages {args.broker_inflight}")
    broker = Broker(workdir / "broker", broker_config)
    broker.start()
    try:
        model = workdir / "model.bin"
        model.write_bytes(os.urandom(args.size_mb * MIB))
        results: dict[str, Any] = {
            "size_mb": args.size_mb,
            "broker": ", ".join(["local mosquitto", *broker_config]),
            "publisher_max_inflight": args.publisher_inflight,
            "fsync_delay_ms": args.fsync_delay_ms,
            "repeat": args.repeat,
            "process": args.process,
            "cases": [],
        }
        for chunk_kib in args.chunk_kib:
            manifest = build_manifest(
                model,
                job_id="bench",
                sequence=1,
                slot="main",
                model_id="random",
                version="1",
                chunk_size=chunk_kib * 1024,
            )
            manifest_file = workdir / f"manifest-{chunk_kib}.json"
            manifest_file.write_text(manifest.model_dump_json())
            raw = _RawCase(broker.port, model, manifest.chunk_size, args.publisher_inflight)
            case = _PullCase(broker.port, model, manifest_file, manifest, args.publisher_inflight)
            try:
                for window in args.window:
                    raws: list[float] = []
                    pulls: list[float] = []
                    raw_cpu: list[float] = []
                    pull_cpu: list[float] = []
                    flush_ms: list[float] = []
                    page_faults: list[int] = []
                    raw_meter = _CpuMeter(raw.pub.proc.pid, broker.pid)
                    pull_meter = _CpuMeter(case.server.proc.pid, broker.pid)
                    verified = True
                    raw.speed()  # warm-up, not counted: first runs pay for cold caches and lazy setup
                    case.speed(window)
                    for _ in range(args.repeat):
                        mb_s, cpu = raw_meter.run(raw.speed)
                        raws.append(mb_s)
                        raw_cpu.append(cpu)
                        speed, cpu = pull_meter.run(functools.partial(case.speed, window))
                        pulls.append(speed["pull_mb_s"])
                        pull_cpu.append(cpu)
                        flush_ms.append(speed["flush_ms"])
                        page_faults.append(speed["page_faults"])
                        verified = verified and speed["verified"] and speed["served_bytes"] == manifest.size
                    raw_mb_s, pull_mb_s = _median(raws), _median(pulls)
                    raw_cpu_s, pull_cpu_s = statistics.median(raw_cpu), statistics.median(pull_cpu)
                    results["cases"].append(
                        {
                            "chunk_kib": chunk_kib,
                            "window": window,
                            "raw_qos1_mb_s": raw_mb_s,
                            "pull_mb_s": pull_mb_s,
                            "ratio": round(pull_mb_s / raw_mb_s, 2),
                            "raw_cpu_s": round(raw_cpu_s, 3),
                            "pull_cpu_s": round(pull_cpu_s, 3),
                            "cpu_ratio": round(raw_cpu_s / max(pull_cpu_s, 1e-9), 2),
                            "pull_flush_ms": round(statistics.median(flush_ms)),
                            "pull_page_faults": round(statistics.median(page_faults)),
                            "raw_samples": [round(x) for x in raws],
                            "pull_samples": [round(x) for x in pulls],
                            "verified": verified,
                            "kill_at_50pct": case.kill_and_resume(window, args.fsync_delay_ms),
                        }
                    )
            finally:
                case.close()
                raw.close()
        json.dump(results, sys.stdout, indent=2)
        print()
    finally:
        broker.kill()


if __name__ == "__main__":
    _quiet_logs()
    child = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] in ("raw", "serve", "pull") else None
    if child is not None and os.environ.get(_PROCESS_VAR) != "python":
        keep_freed_buffers()  # as every edge-agent process
        if child == "pull":
            shorten_gil_switch()  # a device, as the device agent runs
    if child == "raw":
        _child_raw(int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
    elif child == "serve":
        _child_server(int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), Path(sys.argv[5]), int(sys.argv[6]))
    elif child == "pull":
        _child_pull(sys.argv[2:])
    else:
        main()
