"""Rollouts at fleet scale: the controller, the broker and N simulated devices on this machine (JSON).

Per scenario, in a fresh work directory: its own mosquitto, the controller as a child process, the
fleet simulator (``python -m agent.fleetsim``: the agent's own link, delivery service, ledger and
messages, a stand-in model loop), then the rollout driven with the CLI (``fleet rollout start ...
--json``, ``fleet rollout status ID --json``). Scenarios:

1. the model over the MQTT pull; 2. the same from nginx (``http_source``) with the MQTT fallback;
3. 5 % of the devices offline until ~90 s in (``--on-timeout wait``); 4. 3 % of the canary
unhealthy (``--rollback-on-abort``): the gate trips and the canaries end on the previous model;
5. the controller SIGKILLed in the third wave and restarted; 6. the broker SIGKILLed in the third
wave and started again (5 and 6 with shadow and a 4 s probation, as operators run them); 7. engines
for the whole fleet: two fingerprints, the build a stand-in sleep of ``--build-seconds``, one
rollout with ``--no-share-engines`` then one with ``--share-engines``; 8. an upgrade: every engine
key new at start, the model from a sharing deployment, each start-up build asking the fleet;
9. enrollment: N devices holding one claim, from their first request to online with their own
certificates over configs/mosquitto/ (bench/fleet_enroll.py; run alone with ``--scenario 9``);
10. an agent update: every device runs agent release 0.9.0 and holds its wheels, the rollout
(``fleet rollout start --agent-release``) brings 0.9.1, which changes only this package's wheel (a
wheel-shaped zip of this repository's ``agent/`` package; the dependency wheels are stand-ins of
random bytes at about the sizes of their aarch64 Python 3.10 wheels, never moved): rollout time and
bytes pulled per device, against the release's whole size. The installs are the simulator's
(agent/fleetsim/agent_release.py: real transfers, simulated installs).

Each prints seconds per wave and to converge, the controller's CPU and peak RSS, the broker's
counters, bytes pulled per device, where devices ended, jobs run per device (none twice, none
skipped), the simulator's processes, the devices' pull counters (``pulls``: chunks asked for,
request timeouts, the server's wait and busy notices; ``pull_timeout_share``: timeouts over chunks
asked) and the chunk server's (``controller.chunk_server``); scenarios 7 and 8 add builds,
downloads and the on/off ratios.
Results: docs/benchmarks.md.

    .venv/bin/python bench/fleet.py [--devices 1000] [--scenario 1] [--size-mb 5] [--workdir DIR]
        [--build-seconds 300] [--soak 10s] [--workers 16]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any

from fleet_enroll import run_enrollment  # bench/fleet_enroll.py, beside this script

from agent.demo.broker import Broker, free_port
from agent.demo.modelzoo import write_classifier
from agent.fleet.deploy.keys import KeyPairFiles, write_keypair
from agent.fleetsim.device import add_pull_counters
from agent.fleetsim.launcher import read_reports
from agent.fsutil import sha256_file
from agent.mqtt.inbound import InboundMessage
from agent.mqtt.service_client import ServiceClient
from agent.mqtt.settings import MqttSettings

PREFIX = "bench/v1"
_SYS = ("messages/received", "messages/sent", "bytes/received", "bytes/sent", "publish/messages/dropped")
_FINAL = ("DONE", "ABORTED", "SUPERSEDED")


#: Stand-ins for the agent's dependency wheels (aarch64, Python 3.10): file name, size in MB, about
#: their real wheels' sizes. Random bytes: the devices hold them already, so none is ever moved.
_DEPENDENCY_WHEELS = (
    ("numpy-1.26.4-cp310-cp310-manylinux_2_17_aarch64.whl", 14.2),
    ("opencv_python_headless-4.9.0.80-cp37-abi3-manylinux_2_17_aarch64.whl", 28.0),
    ("onnxruntime-1.17.1-cp310-cp310-manylinux_2_27_aarch64.whl", 5.9),
    ("cryptography-42.0.5-cp39-abi3-manylinux_2_28_aarch64.whl", 4.3),
    ("pydantic_core-2.16.3-cp310-cp310-manylinux_2_17_aarch64.whl", 1.8),
    ("PyYAML-6.0.1-cp310-cp310-manylinux_2_17_aarch64.whl", 0.7),
    ("pydantic-2.6.4-py3-none-any.whl", 0.4),
    ("psutil-5.9.8-cp36-abi3-manylinux_2_17_aarch64.whl", 0.3),
    ("urllib3-2.2.1-py3-none-any.whl", 0.12),
    ("securesystemslib-1.0.0-py3-none-any.whl", 0.1),
    ("paho_mqtt-2.0.0-py3-none-any.whl", 0.07),
    ("structlog-24.1.0-py3-none-any.whl", 0.06),
    ("tuf-4.0.0-py3-none-any.whl", 0.05),
)


def _agent_releases(root: Path) -> tuple[Path, Path]:
    """Releases 0.9.0 and 0.9.1: the same dependency wheels, this package's wheel changed."""
    from agent.fleet.deploy.agent_release import make_release, write_release

    shared = root / "wheels"
    shared.mkdir()
    for name, size_mb in _DEPENDENCY_WHEELS:
        (shared / name).write_bytes(os.urandom(int(size_mb * 1024 * 1024)))
    package = Path(__file__).resolve().parents[1] / "agent"
    folders = []
    for version in ("0.9.0", "0.9.1"):
        folder = root / f"agent-{version}"
        folder.mkdir()
        for wheel in shared.iterdir():
            os.link(wheel, folder / wheel.name)
        with zipfile.ZipFile(
            folder / f"edge_agent-{version}-py3-none-any.whl", "w", zipfile.ZIP_DEFLATED
        ) as z:
            for source in sorted(package.rglob("*.py")):
                z.write(source, source.relative_to(package.parent))
            z.writestr(f"edge_agent-{version}.dist-info/VERSION", version)
        write_release(folder, make_release(folder, version=version, python="3.10", platforms=["aarch64"]))
        folders.append(folder)
    return folders[0], folders[1]


def _edge_agent(*args: str) -> list[str]:
    return [sys.executable, "-m", "agent", *args]


def _write_models(root: Path, size_mb: float, count: int = 2) -> list[Path]:
    """v1 (served at start), v2 (deployed), v3 ...: real ONNX classifiers of about ``size_mb`` MB each."""
    classes = max(10, int(size_mb * 1024 * 1024 / (33 * 4)))  # Gemm 32 x classes floats + bias
    return [
        write_classifier(root / f"cls-v{n}.onnx", input_size=32, num_classes=classes, seed=n)
        for n in range(1, count + 1)
    ]


class _SysCounters:
    """mosquitto's ``$SYS/broker/...`` counters, as last published (every second)."""

    def __init__(self, broker: Broker) -> None:
        self.values: dict[str, float] = {}
        self._client = ServiceClient(MqttSettings(host=broker.host, port=broker.port), handler=self._on)
        self._client.start(10.0)
        self._client.subscribe("$SYS/broker/#", qos=0, timeout=10.0)

    def _on(self, message: InboundMessage) -> None:
        key = message.topic.removeprefix("$SYS/broker/")
        if key in _SYS:
            with contextlib.suppress(ValueError):
                self.values[key] = float(message.payload)

    def snapshot(self) -> dict[str, float]:
        return dict(self.values)

    def close(self) -> None:
        self._client.stop()


class _Controller:
    """``edge-agent fleet controller`` as a child process; CPU and peak RSS read from /proc."""

    def __init__(self, config: Path, log: Path) -> None:
        self.config = config
        self.log = log
        self.cpu_s = 0.0
        self.peak_rss_mb = 0.0
        self.restarts = 0
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen[bytes]:
        with self.log.open("ab") as out:
            return subprocess.Popen(
                _edge_agent("fleet", "controller", "--config", str(self.config)), stdout=out, stderr=out
            )

    def sample(self) -> None:
        """Read the child's CPU and peak RSS now (it must be alive: /proc forgets it at exit)."""
        try:
            stat = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            tick = os.sysconf("SC_CLK_TCK")
            self._cpu_now = (int(stat[11]) + int(stat[12])) / tick
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    self.peak_rss_mb = max(self.peak_rss_mb, int(line.split()[1]) / 1024)
        except (OSError, IndexError, ValueError):
            pass

    def kill_and_restart(self) -> None:
        self.sample()
        self.cpu_s += getattr(self, "_cpu_now", 0.0)
        self._cpu_now = 0.0
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.restarts += 1
        self.proc = self._spawn()

    def stop(self) -> dict[str, Any]:
        self.sample()
        self.cpu_s += getattr(self, "_cpu_now", 0.0)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return {
            "cpu_s": round(self.cpu_s, 2),
            "peak_rss_mb": round(self.peak_rss_mb, 1),
            "restarts": self.restarts,
            "chunk_server": self.chunk_stats(),
        }

    def chunk_stats(self) -> dict[str, int]:
        """The chunk server's counters from its ``fleet.chunks.stopped`` log lines, summed over restarts."""
        totals: Counter[str] = Counter()
        for line in self.log.read_text(errors="replace").splitlines():
            if "fleet.chunks.stopped" in line:
                totals.update({k: int(v) for k, v in re.findall(r"(\w+)=(\d+)\b", line)})
        return dict(totals)


class _HttpModels:
    """nginx serving ``directory`` on a free port (a Python http.server without nginx); bytes sent."""

    def __init__(self, directory: Path, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.kind = "nginx" if shutil.which("nginx") or Path("/usr/sbin/nginx").exists() else "python"
        workdir.mkdir(parents=True, exist_ok=True)
        self.access_log = workdir / "access.log"
        if self.kind == "nginx":
            conf = workdir / "nginx.conf"
            conf.write_text(
                f"daemon off;\nworker_processes 1;\npid {workdir}/nginx.pid;\n"
                f"error_log {workdir}/error.log;\n"
                "events { worker_connections 4096; }\n"
                "http {\n"
                f"  access_log {self.access_log};\n  sendfile on;\n"
                f"  client_body_temp_path {workdir}/tmp;\n  proxy_temp_path {workdir}/tmp;\n"
                f"  fastcgi_temp_path {workdir}/tmp;\n  uwsgi_temp_path {workdir}/tmp;\n"
                f"  scgi_temp_path {workdir}/tmp;\n"
                f"  server {{ listen 127.0.0.1:{self.port}; location /models/ {{ alias {directory}/; }} }}\n"
                "}\n"
            )
            binary = shutil.which("nginx") or "/usr/sbin/nginx"
            self.proc = subprocess.Popen([binary, "-c", str(conf)], stderr=subprocess.DEVNULL)
        else:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "http.server", str(self.port), "--bind", "127.0.0.1"],
                cwd=directory.parent,
                stdout=subprocess.DEVNULL,
                stderr=self.access_log.open("wb"),
            )
        time.sleep(0.5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/models"

    def cpu_s(self) -> float:
        """CPU seconds of the server process (nginx: master; its worker is read too)."""
        total = 0.0
        tick = os.sysconf("SC_CLK_TCK")
        pids = [self.proc.pid]
        with contextlib.suppress(OSError):
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
            pids += [int(p) for p in children]
        for pid in pids:
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(stat[11]) + int(stat[12])) / tick
        return total

    def bytes_sent(self) -> int:
        """Body bytes of 200/206 answers (nginx's combined log: the field after the status)."""
        total = 0
        if self.kind != "nginx":
            return -1  # http.server does not log sizes
        for line in self.access_log.read_text(errors="replace").splitlines():
            parts = line.split('"')
            if len(parts) > 2:
                fields = parts[2].split()
                if len(fields) >= 2 and fields[0] in ("200", "206") and fields[1].isdigit():
                    total += int(fields[1])
        return total

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _fleet_json(broker: Broker, *command: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """``edge-agent fleet COMMAND... --json`` against the bench's broker and prefix."""
    return subprocess.run(
        _edge_agent(
            "fleet", *command, "--json", "--broker", f"{broker.host}:{broker.port}", "--prefix", PREFIX
        ),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _rollout_cli(broker: Broker, *args: str, timeout: float = 120.0) -> dict[str, Any]:
    out = _fleet_json(broker, "rollout", *args, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"fleet rollout {args[0]} failed ({out.returncode}): {out.stderr[-2000:]}")
    # With --json stdout is the answer alone (the selection and the upload line go to stderr).
    result: dict[str, Any] = json.loads(out.stdout)
    return result


class _Scenario:
    """One scenario's processes and measurements."""

    def __init__(self, number: int, args: argparse.Namespace, root: Path) -> None:
        self.number = number
        self.args = args
        self.root = root / f"scenario-{number}"
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True)
        self.broker = Broker(self.root / "broker", ["sys_interval 1", "max_queued_messages 100000"])
        self.keys: KeyPairFiles = write_keypair(self.root / "keys", "bench")
        self.models = _write_models(self.root, args.size_mb, 3 if number == 7 else 2)
        self.v1, self.v2 = self.models[:2]
        self.sim: subprocess.Popen[bytes] | None = None
        self.http: _HttpModels | None = None
        self.releases = _agent_releases(self.root) if number == 10 else None

    # -- the parts ---------------------------------------------------------------------------------

    def controller_config(self, http_source: str | None) -> Path:
        state = self.root / "controller"
        models = state / "models"
        models.mkdir(parents=True)
        # The model the devices serve at start is in the repository: a rollback can send it back.
        shutil.copyfile(self.v1, models / f"{sha256_file(self.v1)}.onnx")
        config = self.root / "controller.yaml"
        lines = [
            f"mqtt: {{host: {self.broker.host}, port: {self.broker.port}, prefix: {PREFIX}}}",
            f"state_dir: {state}",
            f"signing_key: {self.keys.private}",
            f"key_id: {self.keys.key_id}",
            f"http_source: {http_source or 'null'}",
        ]
        config.write_text("\n".join(lines) + "\n")
        return config

    def start_sim(self, extra: list[str]) -> None:
        command = [
            sys.executable, "-m", "agent.fleetsim",
            "--broker", f"{self.broker.host}:{self.broker.port}",
            "--prefix", PREFIX,
            "--devices", str(self.args.devices),
            "--trust", str(self.keys.public),
            "--key-id", self.keys.key_id,
            "--state-dir", str(self.root / "sim"),
            "--model", f"main={self.v1}:cls:1",
            "--label", "fleet=bench",
            "--label", "site=berlin,munich,paris,rome",
            *(self._engine_args() if self.number in (7, 8) else []),
            *(["--agent-release", str(self.releases[0])] if self.releases else []),
            *extra,
        ]  # fmt: skip
        with (self.root / "fleetsim.log").open("ab") as out:
            self.sim = subprocess.Popen(command, stdout=out, stderr=out)

    def _engine_args(self) -> list[str]:
        """Two fingerprints (labels alternate), the build stand-in; 8: every device starts upgraded."""
        args = ["--label", "hw=orin-nx,orin-agx", "--build-seconds", str(self.args.build_seconds)]
        # 8: the devices' model came from a sharing deployment, so their start-up builds ask the fleet.
        return [*args, "--upgrade-at", "0", "--share-at-start"] if self.number == 8 else args

    def sim_report(self) -> dict[str, Any]:
        return read_reports(self.root / "sim")

    def wait_devices(self, predicate: Any, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            devices = self.sim_report()["devices"]
            if len(devices) == self.args.devices and predicate(devices):
                return
            time.sleep(1.0)
        raise RuntimeError(f"scenario {self.number}: timed out waiting for {what}")

    # -- a run ---------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        load_at_start = os.getloadavg()
        self.broker.start()
        sys_counters = _SysCounters(self.broker)
        http_source = None
        if self.number == 2:
            self.http = _HttpModels(self.root / "controller" / "models", self.root / "http")
            http_source = self.http.url
        config = self.controller_config(http_source)
        controller = _Controller(config, self.root / "controller.log")
        extra = []
        if self.number == 3:
            extra = ["--offline", "5%:20-110"]
        if self.number == 4:
            canary = max(1, -(-self.args.devices * 5 // 100))
            extra = ["--unhealthy", f"3%@0-{canary - 1}:nan_outputs"]
        started = time.time()
        self.start_sim(extra)
        try:
            self.wait_devices(lambda d: all(x["online"] for x in d.values()), "every device online", 600)
            online_s = time.time() - started
            if self.number == 3:
                self.wait_devices(
                    lambda d: sum(not x["running"] for x in d.values()) >= self.args.devices * 5 // 100,
                    "5% of the devices off",
                    60,
                )
            before = sys_counters.snapshot()
            if self.number == 7:
                result = self._sharing_off_and_on(controller)
            elif self.number == 8:
                result = self._upgrade(started)
            else:
                result = self._rollout(controller)
            after = sys_counters.snapshot()
        finally:
            ctl = controller.stop()
            if self.sim is not None:
                self.sim.send_signal(signal.SIGTERM)
                try:
                    self.sim.wait(timeout=120)
                except subprocess.TimeoutExpired:  # the broker below must still be stopped
                    self.sim.kill()
                    self.sim.wait()
            if self.http is not None:
                self.http.stop()
            sys_counters.close()
            self.broker.kill()
        report = read_reports(self.root / "sim")
        if self.number not in (7, 8):
            result.update(self._devices_view(report, result.get("job_id")))
        result["online_s"] = round(online_s, 1)
        # The machine is shared: the figures mean little without the load they were taken under.
        result["load_average"] = {
            "start": [round(x, 2) for x in load_at_start],
            "end": [round(x, 2) for x in os.getloadavg()],
        }
        result["controller"] = ctl
        if self.number == 6:
            result["broker"] = {k: after.get(k, 0) for k in _SYS}  # since its restart
        else:
            result["broker"] = {k: after.get(k, 0) - before.get(k, 0) for k in _SYS}
        result["simulator"] = {
            "procs": len(report["workers"]),
            "cpu_s": round(sum(w["cpu_s"] for w in report["workers"]), 1),
            "peak_rss_mb_per_proc": max((w["peak_rss_mb"] for w in report["workers"]), default=0),
            "fds_per_proc": max((w["fds"] or 0 for w in report["workers"]), default=0),
        }
        return result

    def _start_args(self, model: Path | None = None, share: bool | None = None) -> list[str]:
        if self.releases is not None:
            return [
                "start", "--agent-release", str(self.releases[1]), "--select", "fleet=bench",
                "--waves", "5%,10%,50%,100%", "--max-failed", "2%", "--retained-wait", "20",
            ]  # fmt: skip
        guarded = self.number in (5, 6, 7)  # shadow and probation on, as operators run them
        probation = {4: "3", 5: "4", 6: "4", 7: "2"}.get(self.number, "0")
        version = (model or self.v2).stem.removeprefix("cls-v")
        args = [
            "start", str(model or self.v2), "--slot", "main", "--select", "fleet=bench",
            "--waves", "1%,5%,10%,50%,100%" if self.number == 7 else "5%,10%,50%,100%",
            "--soak", self.args.soak if self.number == 7 else "0", "--max-failed", "2%",
            "--version", version, "--model-id", "cls", *([] if guarded else ["--no-shadow"]),
            "--probation-s", probation,
            "--retained-wait", "20",
        ]  # fmt: skip
        if share is not None:
            args.append("--share-engines" if share else "--no-share-engines")
        if self.number == 3:
            args += ["--on-timeout", "wait", "--wave-timeout", "10m"]
        if self.number == 4:
            args.append("--rollback-on-abort")
        return args

    def _rollout(
        self, controller: _Controller, model: Path | None = None, share: bool | None = None
    ) -> dict[str, Any]:
        t0 = time.monotonic()
        started = _rollout_cli(self.broker, *self._start_args(model, share), timeout=300)
        rollout_id = started["rollout_id"]
        killed_at = None
        status: dict[str, Any] = {}
        http_cpu0 = self.http.cpu_s() if self.http else 0.0
        # Scenario 7: five waves, each may wait a build (sharing off).
        limit = self.args.timeout + (5 * self.args.build_seconds if self.number == 7 else 0.0)
        while time.monotonic() - t0 < limit:
            controller.sample()
            try:
                status = _rollout_cli(self.broker, "status", rollout_id)
            except RuntimeError as exc:
                # No controller answered in 30 s: the restarted one is starting (5), it has not
                # resubscribed to the restarted broker (6), or the machine is that loaded. Asked
                # again; the loop's --timeout bounds it.
                print(f"scenario {self.number}: {exc}", file=sys.stderr, flush=True)
                time.sleep(self.args.poll_s)
                continue
            third = next((w for w in status["waves"] if w["index"] == 2), None)
            if self.number == 5 and killed_at is None and third is not None and third["started_at"]:
                killed_at = round(time.monotonic() - t0, 1)
                controller.kill_and_restart()
            if self.number == 6 and killed_at is None and third is not None and third["ends"].get("ACTIVE"):
                killed_at = round(time.monotonic() - t0, 1)
                self.broker.kill()
                time.sleep(3.0)  # the outage: back after 3 s
                self.broker.restart(hard=True)
            if status["state"] in _FINAL:
                break
            time.sleep(self.args.poll_s)
        ended = time.monotonic() - t0
        if self.number in (3, 4):
            # The rollout may end before the late devices (or the rollback) converge: wait for them.
            self._wait_converged(status, t0)
        converged = time.monotonic() - t0
        waves = [
            {
                "index": w["index"],
                "devices": w["devices"],
                "state": w["state"],
                "seconds": round((w["ended_at"] or time.time()) - (w["started_at"] or time.time()), 1),
                "ends": w["ends"],
            }
            for w in status.get("waves", [])
        ]
        out: dict[str, Any] = {
            "scenario": self.number,
            "devices": self.args.devices,
            "model_bytes": self.v2.stat().st_size,
            "rollout_id": rollout_id,
            "job_id": status.get("job_id"),
            "state": status.get("state"),
            "reason": status.get("reason"),
            "rollout_s": round(ended, 1),
            "converge_s": round(converged, 1),
            "waves": waves,
            "controller_view": status.get("devices"),
            "rollback": status.get("rollback"),
            "sends": status.get("sends"),
        }
        if self.releases is not None:
            update = self.releases[1]
            changed = update / "edge_agent-0.9.1-py3-none-any.whl"
            out["release"] = {
                "wheels": len(list(update.glob("*.whl"))),
                "bytes": sum(p.stat().st_size for p in update.glob("*.whl")),
                "changed_wheel_bytes": changed.stat().st_size,
                "document_bytes": (update / "agent-release.json").stat().st_size,
            }
        if killed_at is not None:
            out["broker_killed_at_s" if self.number == 6 else "controller_killed_at_s"] = killed_at
        if self.http is not None:
            out["http"] = {
                "server": self.http.kind,
                "bytes_sent": self.http.bytes_sent(),
                "cpu_s": round(self.http.cpu_s() - http_cpu0, 2),
            }
        return out

    def fresh_devices(self, since: float, timeout: float = 30.0) -> dict[str, Any]:
        """The simulator's devices from reports every worker rewrote after ``since`` (Unix time)."""
        deadline = time.monotonic() + timeout
        while True:
            report = self.sim_report()
            if all(w["updated"] > since for w in report["workers"]) or time.monotonic() > deadline:
                devices: dict[str, Any] = report["devices"]
                return devices
            time.sleep(0.5)

    def _sharing_off_and_on(self, controller: _Controller) -> dict[str, Any]:
        """Scenario 7: the same rollout shape, sharing off (model v2) then on (v3), in one run."""
        runs: dict[str, dict[str, Any]] = {}
        for name, share, model in (("off", False, self.models[1]), ("on", True, self.models[2])):
            before = self.fresh_devices(time.time())
            out = self._rollout(controller, model, share)
            version = model.stem.removeprefix("cls-v")
            with contextlib.suppress(RuntimeError):  # where each device ended is in the JSON either way
                self.wait_devices(
                    lambda d, v=version: all(x["slots"]["main"] == f"cls:{v}" for x in d.values()),
                    f"every device on cls:{version}",
                    120,
                )
            time.sleep(5.0)  # the last wave's offers (after ACTIVE) are answered, then counted
            after = self.fresh_devices(time.time())
            runs[name] = {
                "state": out["state"],
                "rollout_s": out["rollout_s"],
                "waves": [{k: w[k] for k in ("devices", "seconds", "ends")} for w in out["waves"]],
                "on_model": sum(d["slots"]["main"] == f"cls:{version}" for d in after.values()),
                **_engine_delta(before, after),
            }
        off, on = runs["off"], runs["on"]
        return {
            "scenario": 7,
            "devices": self.args.devices,
            "build_seconds": self.args.build_seconds,
            "soak": self.args.soak,
            "model_bytes": self.v2.stat().st_size,
            "sharing_off": off,
            "sharing_on": on,
            "ratios": {
                "rollout_time_on_over_off": round(on["rollout_s"] / max(off["rollout_s"], 1e-9), 3),
                "build_seconds_off_over_on": round(off["build_s"] / max(on["build_s"], 1e-9), 1),
            },
            "controller_engines": _engines_list(self.broker),
        }

    def _upgrade(self, launched: float) -> dict[str, Any]:
        """Scenario 8: every device started on JetPack 6.1 with its engine missing (see the docstring)."""
        online = self.fresh_devices(time.time())
        serving_at_online = Counter(str(d["engines"]["serving"].get("main")) for d in online.values())
        all_serving_s = time.time() - launched
        with contextlib.suppress(RuntimeError):
            self.wait_devices(
                lambda d: all(x["engines"]["engine_ready_at"] for x in d.values()),
                "every device on its new engine",
                self.args.build_seconds + self.args.timeout,
            )
        devices = self.fresh_devices(time.time())
        ready = [d["engines"]["engine_ready_at"] for d in devices.values() if d["engines"]["engine_ready_at"]]
        after_start = sorted(
            d["engines"]["engine_ready_at"] - d["engines"]["up_since"]
            for d in devices.values()
            if d["engines"]["engine_ready_at"] and d["engines"]["up_since"]
        )
        return {
            "scenario": 8,
            "devices": self.args.devices,
            "build_seconds": self.args.build_seconds,
            "platforms": dict(Counter(str(d["engines"]["platform"]) for d in devices.values())),
            "all_serving_s": round(all_serving_s, 1),
            "serving_when_all_online": dict(serving_at_online),
            "all_on_new_engine_s": round(max(ready) - launched, 1) if len(ready) == len(devices) else None,
            "on_new_engine": len(ready),
            "engine_after_device_start_s": {
                "median": round(after_start[len(after_start) // 2], 1) if after_start else None,
                "max": round(after_start[-1], 1) if after_start else None,
            },
            **_engine_delta({}, devices),
            "controller_engines": _engines_list(self.broker),
        }

    def _wait_converged(self, status: dict[str, Any], t0: float) -> None:
        # Scenario 3: the late devices come back ~90 s after the start; 4: the rollback's new desired
        # state (the previous model is in every store: no download). Bounded: the JSON says where
        # each device ended either way.
        deadline = min(t0 + self.args.timeout, time.monotonic() + (150.0 if self.number == 3 else 60.0))
        while time.monotonic() < deadline:
            devices = self.sim_report()["devices"]
            if self.number == 3 and all(d["slots"]["main"] == "cls:2" for d in devices.values()):
                return
            if self.number == 4 and all(d["slots"]["main"] == "cls:1" for d in devices.values()):
                return
            time.sleep(2.0)

    def _devices_view(self, report: dict[str, Any], job_id: str | None) -> dict[str, Any]:
        devices = report["devices"]
        runs = Counter(sum(d["runs"].values()) for d in devices.values())
        fetched = [d["fetched_bytes"] for d in devices.values()]
        pulls = _pull_totals(devices.values())
        return {
            "devices_view": {
                "slot_main": dict(Counter(str(d["slots"]["main"]) for d in devices.values())),
                "last_end": dict(Counter(_last_end(d, job_id) for d in devices.values())),
                "touched": sum(1 for d in devices.values() if job_id in d["jobs"]),
                "jobs_run_per_device": {str(k): v for k, v in sorted(runs.items())},
                "rollout_job_twice": sum(1 for d in devices.values() if d["runs"].get(job_id, 0) > 1),
            },
            "agent_release": dict(Counter(str(d.get("agent_release")) for d in devices.values())),
            "pulled_bytes_per_device": {
                "mean": round(sum(fetched) / max(1, len(fetched))),
                "max": max(fetched, default=0),
            },
            "pulls": pulls,
            # Chunks asked for again after a timeout, over all chunks asked for (the pacing's measure).
            "pull_timeout_share": round(
                pulls.get("timeouts", 0) / max(1, pulls.get("requested_chunks", 0)), 4
            ),
        }


def _pull_totals(devices: Any) -> dict[str, int]:
    """The devices' MQTT pull counters (PullStats) summed, the largest where a field is a maximum."""
    totals: Counter[str] = Counter()
    for device in devices:
        add_pull_counters(totals, device.get("pull", {}))
        totals["inbox_dropped"] += int(device.get("inbox_dropped", 0))
    return dict(totals)


_ENGINE_SUMS = (
    "builds", "build_s", "downloads", "download_bytes", "download_s", "asked", "waited", "uploaded",
)  # fmt: skip


def _engine_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The devices' engine counters (agent/fleetsim/build.py) between two reports, summed: builds,
    device build-seconds, downloads and their bytes and seconds, asks, uploads; builds and downloads
    per fingerprint."""
    totals: Counter[str] = Counter()
    per_fp: dict[str, Counter[str]] = {}
    for device_id, device in after.items():
        now = device.get("engines") or {}
        then = (before.get(device_id) or {}).get("engines") or {}
        for key in _ENGINE_SUMS:
            totals[key] += now.get(key, 0) - then.get(key, 0)
        for fp, row in now.get("by_fingerprint", {}).items():
            old = then.get("by_fingerprint", {}).get(fp, {})
            counts = per_fp.setdefault(fp, Counter())
            for key in ("builds", "downloads"):
                counts[key] += row.get(key, 0) - old.get(key, 0)
    out: dict[str, Any] = {k: round(v, 1) if isinstance(v, float) else v for k, v in totals.items()}
    out["per_fingerprint"] = {fp: dict(c) for fp, c in sorted(per_fp.items()) if any(c.values())}
    return out


def _engines_list(broker: Broker) -> dict[str, Any]:
    """``fleet engines list --json``: per fingerprint, the engines the controller holds and their reuse."""
    out = _fleet_json(broker, "engines", "list")
    if out.returncode != 0:
        return {"error": out.stderr[-500:]}
    listing: dict[str, Any] = json.loads(out.stdout)
    return {
        "engines": listing.get("engines"),
        "bytes": listing.get("bytes"),
        "reuse": {
            fp: [{"built_by": r["built_by"], "reuse": r["reuse"]} for r in rows]
            for fp, rows in listing.get("fingerprints", {}).items()
        },
        "live_claims": len(listing.get("claims", [])),
    }


def _last_end(device: dict[str, Any], job_id: str | None) -> str:
    states = device["jobs"].get(job_id) if job_id else None
    return states[-1] if states else "untouched"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=1000)
    p.add_argument(
        "--scenario", type=int, action="append", choices=(1, 2, 3, 4, 5, 6, 7, 8, 9, 10), default=None
    )
    p.add_argument("--size-mb", type=float, default=5.0)
    p.add_argument("--timeout", type=float, default=900.0, help="longest a rollout may take (s)")
    p.add_argument("--poll-s", type=float, default=5.0, help="seconds between status polls")
    p.add_argument(
        "--build-seconds",
        type=float,
        default=300.0,
        help="7, 8: seconds per simulated engine build (default 300: a YOLO-class FP16 engine on an Orin NX)",
    )
    p.add_argument(
        "--soak", default="10s", help="7: soak after each wave (the canary's offer lands meanwhile)"
    )
    p.add_argument("--workers", type=int, default=16, help="9: devices enrolling at once (threads)")
    p.add_argument("--workdir", type=Path, default=None, help="default: a temporary directory, removed")
    args = p.parse_args()
    os.environ.setdefault("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    root = args.workdir or Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    results = []
    try:
        for number in args.scenario or [1, 2, 3, 4, 5, 6, 7, 8]:
            if number == 9:
                result = run_enrollment(root, args.devices, args.workers, _Controller)
            else:
                result = _Scenario(number, args, root).run()
            print(json.dumps(result), flush=True)
            results.append(result)
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
