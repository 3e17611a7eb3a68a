"""A simulated fleet publishing through a real broker to a real fleet controller, whose /metrics a
real Prometheus scrapes (no tests here).

The devices are simulated (no agent processes): each is a plain paho client (tests/mqtt_probe.py)
publishing real protocol messages (retained status and info, telemetry every
:data:`TELEMETRY_EVERY_S`) with the field names of docs/operations.md. The controller is the real
one (its live view, its store, its HTTP server on a free port); one rollout written to its store
makes the rollout series exist too.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from agent.demo.broker import Broker, free_port
from agent.fleet.controller.config import ControllerConfig, HttpSettings
from agent.fleet.controller.process import FleetController
from agent.fleet.rollout.records import RolloutPlan
from agent.protocol.messages import (
    CertificateInfo,
    InfoMessage,
    JobEnd,
    JobState,
    JobStatus,
    ModelRef,
    SlotInfo,
    StatusMessage,
    TelemetryMessage,
    encode,
)
from agent.protocol.topics import Topics
from tests.fleet.operator_side import operator_settings, unique_prefix
from tests.mqtt_probe import Probe
from tests.prometheus_server import Prometheus
from tests.waiting import patient

TELEMETRY_EVERY_S = 0.5
#: Seconds of silence after which the view calls a device stale (short, so tests see it happen).
STALE_AFTER_S = 3.0


def figures(index: int) -> dict[str, float]:
    """A device's telemetry (every kind of field the dashboard charts); values differ per device."""
    return {
        "stream.cam0.fps": 20.0 + index,
        "stream.cam0.frames_captured": 1000.0 * (index + 1),
        "stream.cam0.frames_published": 990.0 * (index + 1),
        "stream.cam0.dropped.queue_full": 5.0 + index,
        "stream.cam0.dropped.infer_error": 1.0,
        "stream.cam0.latency.total.p50_ms": 8.0 + index,
        "stream.cam0.latency.total.p95_ms": 11.0 + index,
        "stream.cam0.latency.total.p99_ms": 15.0 + index,
        "stream.cam0.latency.total.count": 990.0 * (index + 1),
        "stream.cam0.capture_fps": 25.0 + index,
        "stream.cam0.source.state": 2.0,
        "stream.cam0.source.last_frame_age_s": 0.04,
        "slot.main.latency.infer.p99_ms": 6.0,
        "slot.main.active": 1.0,
        "slot.main.shadow.active": 0.0,
        "slot.main.probation.active": 0.0,
        "mqtt.connected": 1.0,
        "mqtt.spool_depth": float(index),
        "spool.rows": float(index),
        "spool.bytes": 4096.0 * index,
        "spool.max_rows": 1_000_000.0,
        "spool.max_bytes": 1073741824.0,
        "process.cpu_percent": 30.0 + index,
        "process.rss_mb": 300.0 + index,
        "cpu.percent": 45.0,
        "memory.used_mb": 3000.0,
        "memory.available_mb": 5000.0,
        "temp.cpu_therm_c": 50.0 + index,
        "temp.gpu_therm_c": 48.0,
        "gpu.load_percent": 60.0,
        "gpu.freq_mhz": 918.0,
        "emc.freq_mhz": 2133.0,
        "dla0.freq_mhz": 1600.0,
        # A fleet root valid for a year (docs/trust.md): its alerts stay quiet.
        "trust.root_version": 1.0,
        "trust.root_expired": 0.0,
        "trust.root_expires_in_s": 365 * 86400.0,
    }


class SimulatedDevice:
    """A fake Jetson for fleet tests (there is no fleet of real devices here): it publishes what an
    agent would, through the real broker, until told to go silent or offline."""

    def __init__(self, broker: Broker, prefix: str, name: str, index: int, site: str) -> None:
        self.name = name
        self.index = index
        self.topics = Topics(prefix, name)
        self.probe = Probe(broker.host, broker.port, client_id=f"sim-{name}-{prefix.replace('/', '-')}")
        self.publishing = True
        self.probe.publish(self.topics.status, encode(self._status("online")), retain=True)
        info = InfoMessage(
            device_id=name,
            agent_version="0.9.1",
            platform={"device_model": "Jetson Orin NX", "jetpack": "6.0", "dla_cores": 2},
            labels={"site": site, "hw": "orin-nx"},
            backends={},
            slots={
                "main": SlotInfo(
                    model=ModelRef(
                        slot="main", model_id="detector", version=f"{4 + index % 2}", sha256="ab" * 32
                    ),
                    state="active",
                    last_failure=JobEnd(
                        job_id="j0", state=JobState.ROLLED_BACK, error_code="unhealthy", ts=1e9
                    ),
                )
            },
            streams=["cam0"],
            # Its certificate has 90 days left: the expiry alert has series and does not fire.
            certificate=CertificateInfo(serial=f"{index + 1:x}", not_after=time.time() + 90 * 86400),
        )
        self.probe.publish(self.topics.info, encode(info), retain=True)
        job = JobStatus(job_id=f"job-{name}", slot="main", state=JobState.ACTIVE)
        self.probe.publish(self.topics.jobs(job.job_id), encode(job))

    def _status(self, state: str) -> StatusMessage:
        return StatusMessage(state=state, session=1, agent_version="0.9.1")

    def tick(self) -> None:
        if self.publishing:
            self.probe.publish(self.topics.telemetry, encode(TelemetryMessage(**figures(self.index))), qos=0)

    def go_offline(self) -> None:
        """A graceful stop: telemetry ends and the retained status says offline."""
        self.publishing = False
        self.probe.publish(self.topics.status, encode(self._status("offline")), retain=True)

    def close(self) -> None:
        self.probe.close()


class ScrapedFleet:
    """Devices -> broker -> FleetView -> /metrics -> Prometheus; ``close()`` stops it all."""

    def __init__(
        self,
        broker: Broker,
        workdir: Path,
        sites: dict[str, str],
        rule_files: list[Path] | None = None,
        alertmanagers: list[str] | None = None,
    ) -> None:
        self.prefix = unique_prefix()
        config = ControllerConfig(
            mqtt=operator_settings(broker, self.prefix),
            state_dir=workdir / "controller",
            unsigned=True,
            stale_after_s=STALE_AFTER_S,
            http=HttpSettings(port=free_port()),
        )
        self.controller = FleetController(config).start()
        self.view = self.controller.view
        assert self.controller.store is not None
        self.store = self.controller.store
        names = sorted(sites)
        self.store.create(RolloutPlan("r-1", "main", "job-r-1", "5", waves=[names[:1], names[1:]]))
        self.devices = {
            name: SimulatedDevice(broker, self.prefix, name, i, site)
            for i, (name, site) in enumerate(sorted(sites.items()))
        }
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sim-fleet", daemon=True)
        self._thread.start()
        port = self.controller.config.http.port
        self.prometheus = Prometheus(workdir / "prometheus", [f"127.0.0.1:{port}"], rule_files, alertmanagers)

    def _run(self) -> None:
        while not self._stop.wait(TELEMETRY_EVERY_S):
            for device in list(self.devices.values()):
                device.tick()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(patient(5))
        self.prometheus.stop()
        self.controller.stop()
        for device in self.devices.values():
            device.close()
