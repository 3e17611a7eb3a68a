"""One controller against a 10,000-device fleet over a real mosquitto: what an idle fleet costs it,
its ``/metrics`` scrape time (the first after start included), and the telemetry rate it keeps up
with (JSON).

The devices are simulated. One fleet simulator device (``python -m agent.fleetsim --devices 1``: the
agent's own link, spool and delivery service, a simulated model loop) runs first, and the
``up/status``, ``up/info`` and ``up/telemetry`` it publishes are captured. Publisher processes then
send those payloads, the device id swapped, for ``--devices`` ids over a few MQTT connections, as
that many agents would (agent/app/device_reports.py): the retained status and info once (QoS 1), and
telemetry every ``--telemetry-s`` seconds per device (the agent's ``telemetry.interval_s``, 10 s),
QoS 0, spread over the interval. There is one MQTT connection per publisher, not per device: the
broker holds every device's retained messages but not its session or Last Will.

The controller is the real one (``edge-agent fleet controller``, its console and ``/metrics`` on a
loopback port), a child process; CPU and RSS from /proc, ``/metrics`` fetched as Prometheus fetches
it (gzip).

- ``idle``: the controller started after the fleet's retained messages are on the broker.
  ``first_scrape_s``: the first scrape, as soon as the port answers (``..._cpu_s``: the
  controller's CPU seconds meanwhile, all its threads, in /proc's 10 ms ticks); ``filled_s``: when the
  controller had taken every device's status and info (its ``edge_fleet_devices`` says so, read
  from scrapes 2 s apart: those scrapes are ``fill_scrapes_s``); ``full_scrape_s``: the
  first scrape after it filled; then ``--idle-s`` seconds of the idle fleet: the controller's CPU
  (cores) and RSS, the broker's CPU, scrapes every 5 s.
- ``ingest``: telemetry at each rate of ``--rates`` (messages a second, the whole fleet) for
  ``--step-s`` seconds: what the publishers sent, what the broker dropped (its
  ``$SYS/broker/publish/messages/dropped``), what the controller took into its view
  (``edge_fleet_telemetry_messages_total``) and shed (``edge_fleet_mqtt_dropped_total``), and the
  CPU of the controller, the broker and the publishers. ``kept_up``: the controller took at least
  99 % of what the publishers sent.

Every figure carries ``uptime``'s load average at the time (the machine is shared).

    .venv/bin/python bench/controller_scale.py [--devices 10000] [--idle-s 30]
        [--rates 1000 2000 4000 8000] [--step-s 20] [--publishers 2]
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Any

from agent.demo.broker import Broker, free_port
from agent.demo.modelzoo import write_classifier
from agent.fleet.deploy.keys import write_keypair
from agent.mqtt.inbound import InboundMessage
from agent.mqtt.service_client import ServiceClient
from agent.mqtt.settings import MqttSettings
from agent.protocol.topics import Topics

PREFIX = "scale/v1"
#: ``max_queued_messages`` of the broker configuration this project ships (configs/mosquitto):
#: every device's retained status and info count against it when the controller subscribes.
SHIPPED_BROKER_QUEUE = 100_000
SAMPLE_ID = "sample-0000"
REPO = Path(__file__).resolve().parents[1]
#: Broker statistics read once a second ($SYS topics of mosquitto 2.0).
SYS_TOPICS = ("$SYS/broker/publish/messages/dropped", "$SYS/broker/messages/received")


def load() -> str:
    """``uptime``'s load averages (1, 5, 15 min) now."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def _env() -> dict[str, str]:
    paths = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths))


def _cpu_s(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> tuple[float, float]:
    """(RSS now, peak RSS) in MB."""
    now = peak = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            now = int(line.split()[1]) / 1024
        elif line.startswith("VmHWM:"):
            peak = int(line.split()[1]) / 1024
    return round(now, 1), round(peak, 1)


# -- the simulated devices' payloads -----------------------------------------------------------------


def capture_device(broker: Broker, root: Path, telemetry_s: float) -> dict[str, bytes]:
    """What one fleet simulator device publishes: its status, info and one telemetry payload."""
    keys = write_keypair(root / "keys", "bench")
    model = write_classifier(root / "cls.onnx", input_size=32, num_classes=10, seed=1)
    topics = Topics(PREFIX, SAMPLE_ID)
    wanted = {topics.status: "status", topics.info: "info", topics.telemetry: "telemetry"}
    got: dict[str, bytes] = {}
    done = threading.Event()

    def take(message: InboundMessage) -> None:
        kind = wanted.get(message.topic)
        if kind is not None and message.payload and kind not in got:  # the first: online, not the stop's
            got[kind] = message.payload
            if len(got) == len(wanted):
                done.set()

    listener = ServiceClient(MqttSettings(host=broker.host, port=broker.port), handler=take).start()
    command = [
        sys.executable, "-m", "agent.fleetsim", "--broker", f"{broker.host}:{broker.port}",
        "--prefix", PREFIX, "--devices", "1", "--id-prefix", "sample", "--procs", "1",
        "--trust", str(keys.public), "--key-id", keys.key_id, "--state-dir", str(root / "sim"),
        "--model", f"main={model}:cls:1", "--label", "site=site-1", "--telemetry-s", "1",
    ]  # fmt: skip
    sim = subprocess.Popen(command, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for topic in wanted:
            listener.subscribe(topic, qos=1)
        if not done.wait(120):
            raise RuntimeError(f"the simulated device sent only {sorted(got)} within 120 s")
    finally:
        sim.send_signal(signal.SIGTERM)
        sim.wait(60)
        listener.stop()
    # The sample device's retained topics go: only the replayed fleet stays on the broker.
    cleaner = ServiceClient(MqttSettings(host=broker.host, port=broker.port)).start()
    for topic in (topics.status, topics.info):
        cleaner.publish(topic, b"", qos=1, retain=True)
    cleaner.wait_published(10)
    cleaner.stop()
    return got


def device_ids(count: int) -> list[str]:
    return [f"jet-{i:05d}" for i in range(count)]


def _publisher(
    number: int,
    publishers: int,
    address: tuple[str, int],
    payloads: dict[str, bytes],
    devices: int,
    telemetry_s: float,
    rate: Synchronized,  # type: ignore[type-arg]
    sent: Synchronized,  # type: ignore[type-arg]
    ready: Any,
    stop: Any,
) -> None:
    """One publisher process: the retained status and info of its share of the devices, then their
    telemetry, at ``rate`` messages a second over the whole fleet (0: each device every
    ``telemetry_s``), paced in 10 ms slices."""
    mine = device_ids(devices)[number::publishers]
    client = ServiceClient(
        MqttSettings(host=address[0], port=address[1]), client_id=f"bench-fleet-{number}", max_inflight=1000
    ).start(30)
    sample = SAMPLE_ID.encode()
    for device in mine:
        topics = Topics(PREFIX, device)
        name = device.encode()
        client.publish(topics.status, payloads["status"].replace(sample, name), qos=1, retain=True)
        client.publish(topics.info, payloads["info"].replace(sample, name), qos=1, retain=True)
    client.wait_published(300)
    ready.set()
    body = payloads["telemetry"]
    telemetry = [(Topics(PREFIX, d).telemetry, body.replace(sample, d.encode())) for d in mine]
    k = 0
    owed = 0.0
    while not stop.is_set():
        started = time.monotonic()
        asked = rate.value / publishers if rate.value > 0 else len(mine) / telemetry_s
        owed += asked / 100
        count = int(owed)
        owed -= count
        for _ in range(count):
            topic, payload = telemetry[k % len(telemetry)]
            client.publish(topic, payload, qos=0)
            k += 1
        with sent.get_lock():
            sent.value += count
        stop.wait(max(0.0, 0.01 - (time.monotonic() - started)))
    client.stop()


class SimulatedFleet:
    """``devices`` simulated devices replayed by ``publishers`` processes (see the module docstring)."""

    def __init__(
        self, broker: Broker, payloads: dict[str, bytes], devices: int, telemetry_s: float, publishers: int
    ) -> None:
        self.telemetry_s = telemetry_s
        self.rate: Synchronized = mp.Value("d", 0.0)  # type: ignore[type-arg]
        self.sent: Synchronized = mp.Value("q", 0)  # type: ignore[type-arg]
        self._stop = mp.Event()
        self._ready = [mp.Event() for _ in range(publishers)]
        self.procs = [
            mp.Process(
                target=_publisher,
                args=(
                    n,
                    publishers,
                    (broker.host, broker.port),
                    payloads,
                    devices,
                    telemetry_s,
                    self.rate,
                    self.sent,
                    self._ready[n],
                    self._stop,
                ),
                daemon=True,
            )
            for n in range(publishers)
        ]

    def start(self) -> None:
        for proc in self.procs:
            proc.start()
        for ready in self._ready:
            if not ready.wait(600):
                raise RuntimeError("the publishers did not publish the fleet's retained messages in 600 s")

    def cpu_s(self) -> float:
        return sum(_cpu_s(p.pid) for p in self.procs if p.pid is not None)

    def stop(self) -> None:
        self._stop.set()
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


# -- the controller ------------------------------------------------------------------------------


class Controller:
    """``edge-agent fleet controller`` as a child process, its ``/metrics`` on a loopback port."""

    def __init__(self, root: Path, broker: Broker, devices: int, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        config = root / "controller.yaml"
        config.write_text(
            f"mqtt: {{host: {broker.host}, port: {broker.port}, prefix: {PREFIX}}}\n"
            f"state_dir: {root / 'controller'}\n"
            "unsigned: true\n"
            f"max_devices: {max(devices * 2, 10_000)}\n"
            f"http: {{port: {port}}}\n"
        )
        self.log = root / "controller.log"
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "agent", "fleet", "controller", "--config", str(config)],
                stdout=out,
                stderr=out,
                env=_env(),
            )
        self.started = time.monotonic()
        self.last_cpu_s = 0.0

    def scrape(self, timeout: float = 60.0) -> tuple[float, str]:
        """Seconds from the request to the last byte, and the exposition text; the controller's CPU
        seconds meanwhile (all its threads: the scrape and the telemetry it took) in ``last_cpu_s``."""
        request = urllib.request.Request(self.url, headers={"Accept-Encoding": "gzip"})
        cpu = _cpu_s(self.proc.pid)
        started = time.perf_counter()
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            body = reply.read()
            zipped = reply.headers.get("Content-Encoding") == "gzip"
        elapsed = time.perf_counter() - started
        self.last_cpu_s = round(_cpu_s(self.proc.pid) - cpu, 2)
        return elapsed, (gzip.decompress(body) if zipped else body).decode()

    def wait_port(self, timeout: float) -> float:
        """Seconds from the start until ``/metrics`` answers at all (a refused connection: not yet)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the controller exited; log:\n{self.log.read_text(errors='replace')}")
            try:
                with urllib.request.urlopen(self.url.replace("/metrics", "/healthz"), timeout=5):
                    pass
            except urllib.error.HTTPError:
                pass  # it answers (404 or 401): serving
            except OSError:
                time.sleep(0.05)
                continue
            return time.monotonic() - self.started
        raise RuntimeError("the controller's HTTP port did not answer")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def metric(text: str, name: str, labels: str = "") -> float:
    """The value of sample ``name{labels}`` in exposition ``text`` (0 when absent)."""
    found = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def online(text: str) -> int:
    return int(metric(text, "edge_fleet_devices", '{state="online"}'))


def described(text: str) -> int:
    """Devices whose up/info the controller holds (a platform line each)."""
    return text.count("edge_device_platform_info{")


def counts(text: str) -> dict[str, float]:
    return {
        "taken": metric(text, "edge_fleet_telemetry_messages_total"),
        "shed": metric(text, "edge_fleet_mqtt_dropped_total", '{reason="telemetry_shed"}'),
        "dropped": metric(text, "edge_fleet_mqtt_dropped_total", '{reason="inbox_full"}'),
    }


class BrokerStats:
    """The broker's ``$SYS`` counters, as it publishes them (``sys_interval 1``)."""

    def __init__(self, broker: Broker) -> None:
        self.values: dict[str, float] = {}
        self._client = ServiceClient(MqttSettings(host=broker.host, port=broker.port), handler=self._take)
        self._client.start()
        for topic in SYS_TOPICS:
            self._client.subscribe(topic, qos=0)

    def _take(self, message: InboundMessage) -> None:
        with contextlib.suppress(ValueError):
            self.values[message.topic.rsplit("/", 1)[-1]] = float(message.payload)

    def stop(self) -> None:
        self._client.stop()


# -- the two measurements ------------------------------------------------------------------------


def idle(
    ctl: Controller, broker: Broker, fleet: SimulatedFleet, devices: int, idle_s: float, fill_timeout_s: float
) -> dict[str, Any]:
    out: dict[str, Any] = {"load_at_start": load()}
    out["port_open_s"] = round(ctl.wait_port(120), 2)
    first, text = ctl.scrape()
    out["first_scrape_s"] = round(first, 3)
    out["first_scrape_cpu_s"] = ctl.last_cpu_s
    out["first_scrape_devices"] = online(text)
    fill: list[float] = []
    while online(text) < devices or described(text) < devices:
        if time.monotonic() - ctl.started > fill_timeout_s:
            break  # reported as it is: online and described below the fleet
        time.sleep(2.0)
        elapsed, text = ctl.scrape()
        fill.append(round(elapsed, 3))
        print(f"fill: {online(text)} online, {described(text)} described", file=sys.stderr, flush=True)
    out["filled_s"] = round(time.monotonic() - ctl.started, 1)
    out["filled_online"], out["filled_described"] = online(text), described(text)
    out["fill_scrapes_s"] = fill
    elapsed, text = ctl.scrape()
    out["full_scrape_s"] = round(elapsed, 3)
    out["full_scrape_cpu_s"] = ctl.last_cpu_s
    out["series"] = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
    out["bytes"] = len(text)
    out["after_fill"] = counts(text)
    out["load_after_fill"] = load()
    cpu0, bcpu0, pcpu0 = _cpu_s(ctl.proc.pid), _cpu_s(broker.pid or 0), fleet.cpu_s()
    started = time.monotonic()
    scrapes: list[float] = []
    scrapes_cpu: list[float] = []
    while time.monotonic() - started < idle_s:
        time.sleep(5.0)
        elapsed, text = ctl.scrape()
        scrapes.append(round(elapsed, 3))
        scrapes_cpu.append(ctl.last_cpu_s)
    span = time.monotonic() - started
    out["idle"] = {
        "seconds": round(span, 1),
        "telemetry_per_s_asked": round(devices / fleet.telemetry_s, 1),
        "controller_cores": round((_cpu_s(ctl.proc.pid) - cpu0) / span, 3),
        "controller_rss_mb": _rss_mb(ctl.proc.pid),
        "broker_cores": round((_cpu_s(broker.pid or 0) - bcpu0) / span, 3),
        "broker_rss_mb": _rss_mb(broker.pid or 0),
        "publishers_cores": round((fleet.cpu_s() - pcpu0) / span, 3),
        "scrapes_s": scrapes,
        "scrapes_cpu_s": scrapes_cpu,
        "online": online(text),
        "counters": counts(text),
        "load": load(),
    }
    return out


def ingest(
    ctl: Controller,
    broker: Broker,
    fleet: SimulatedFleet,
    stats: BrokerStats,
    rates: list[float],
    step_s: float,
) -> list[dict[str, Any]]:
    """Per rate: sent and taken counted between the same two moments (the sent count read just
    before each of the two scrapes that read the controller's counters)."""
    rows = []
    for rate in rates:
        fleet.rate.value = rate
        time.sleep(3.0)  # the publishers reach the rate
        sent0 = fleet.sent.value
        drop0, recv0 = stats.values.get("dropped", 0.0), stats.values.get("received", 0.0)
        cpu0, bcpu0, pcpu0 = _cpu_s(ctl.proc.pid), _cpu_s(broker.pid or 0), fleet.cpu_s()
        started = time.monotonic()
        _, text = ctl.scrape()
        before = counts(text)
        time.sleep(step_s)
        sent = fleet.sent.value - sent0
        _, text = ctl.scrape()
        after = counts(text)
        span = time.monotonic() - started
        cpu, bcpu, pcpu = _cpu_s(ctl.proc.pid) - cpu0, _cpu_s(broker.pid or 0) - bcpu0, fleet.cpu_s() - pcpu0
        time.sleep(2.0)  # the broker's $SYS counters catch up (published once a second)
        taken = after["taken"] - before["taken"]
        rows.append(
            {
                "asked_per_s": rate,
                "sent_per_s": round(sent / span),
                "broker_received_per_s": round((stats.values.get("received", 0.0) - recv0) / (span + 2.0)),
                "broker_dropped": int(stats.values.get("dropped", 0.0) - drop0),
                "controller_taken_per_s": round(taken / span),
                "controller_shed": int(after["shed"] - before["shed"]),
                "controller_dropped": int(after["dropped"] - before["dropped"]),
                "lost": int(sent - taken),
                "kept_up": taken >= 0.99 * sent,
                "controller_cores": round(cpu / span, 3),
                "taken_per_controller_core_s": round(taken / cpu) if cpu else None,
                "broker_cores": round(bcpu / span, 3),
                "publishers_cores": round(pcpu / span, 3),
                "controller_rss_mb": _rss_mb(ctl.proc.pid),
                "load": load(),
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    fleet.rate.value = 0.0
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=10_000)
    p.add_argument("--telemetry-s", type=float, default=10.0, help="seconds between a device's telemetry")
    p.add_argument("--idle-s", type=float, default=30.0)
    p.add_argument("--rates", type=float, nargs="*", default=[1000, 2000, 4000, 8000])
    p.add_argument("--step-s", type=float, default=20.0)
    p.add_argument("--publishers", type=int, default=2)
    p.add_argument(
        "--broker-queue",
        type=int,
        default=SHIPPED_BROKER_QUEUE,
        help="mosquitto's max_queued_messages (default: configs/mosquitto's; 0: mosquitto's own, 1000, "
        "with which only about 1,000 devices' retained messages reach a new subscription)",
    )
    p.add_argument("--fill-timeout-s", type=float, default=180.0, help="give up waiting for every device")
    p.add_argument("--port", type=int, default=0, help="the controller's HTTP port (0: a free one)")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-ctl-scale-"))
    queue = [f"max_queued_messages {args.broker_queue}"] if args.broker_queue else []
    broker = Broker(root / "broker", ["sys_interval 1", *queue])
    out: dict[str, Any] = {
        "devices": args.devices,
        "telemetry_s": args.telemetry_s,
        "broker_max_queued_messages": args.broker_queue or "mosquitto default (1000)",
        "load_at_start": load(),
    }
    fleet = ctl = stats = None
    try:
        broker.start()
        payloads = capture_device(broker, root, args.telemetry_s)
        out["payload_bytes"] = {kind: len(body) for kind, body in payloads.items()}
        fleet = SimulatedFleet(broker, payloads, args.devices, args.telemetry_s, args.publishers)
        started = time.monotonic()
        fleet.start()
        out["fleet_published_s"] = round(time.monotonic() - started, 1)
        stats = BrokerStats(broker)
        ctl = Controller(root, broker, args.devices, args.port or free_port())
        out.update(idle(ctl, broker, fleet, args.devices, args.idle_s, args.fill_timeout_s))
        if args.rates:
            out["ingest"] = ingest(ctl, broker, fleet, stats, args.rates, args.step_s)
        out["load_at_end"] = load()
    finally:
        if ctl is not None:
            ctl.stop()
        if stats is not None:
            stats.stop()
        if fleet is not None:
            fleet.stop()
        broker.kill()
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
