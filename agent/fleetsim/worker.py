"""One simulator process: its share of the devices, their offline windows, telemetry, and its report.

:class:`SimWorker` runs the devices it was given on threads (each device has the agent's own
threads: the link's network and dispatcher threads, the delivery service's upkeep, command and slot
threads). A control loop, twice a second, switches devices off and on as their offline windows
say, publishes each device's telemetry every ``telemetry_s`` (spread over the interval), and
rewrites the worker's report, ``{state_dir}/report-{worker}.json`` (atomically, every
``report_s``), which the launcher and the benchmark read: per device its job states per job id, how
often each job was QUEUED (ran), the bytes it fetched, its slots' models; per process CPU seconds,
RSS and open file descriptors.
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import structlog

from agent.fleetsim.build import BuildCounters
from agent.fleetsim.device import FleetSetup, JobJournal, SimDevice
from agent.fleetsim.plan import DevicePlan
from agent.fleetsim.slot import SimSlots
from agent.fsutil import atomic_write_json

log = structlog.get_logger(__name__)

TICK_S = 0.5
#: Default seconds between report rewrites (``--report-s``; tests that wait for a fresh report ask less).
REPORT_EVERY_S = 2.0
_STOP_TIMEOUT_S = 4.0


def report_path(state_dir: Path, worker: int) -> Path:
    return state_dir / f"report-{worker}.json"


def _proc_status_mb(field: str) -> float:
    """``VmRSS``/``VmHWM`` of this process from /proc, in MB (0 where /proc is absent)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


class _Member:
    """One device of the worker: its plan, its slots and journal (kept across restarts), its agent."""

    def __init__(self, plan: DevicePlan, setup: FleetSetup) -> None:
        self.plan = plan
        initial = {name: slot.model for name, slot in setup.slots.items()}
        specs = {name: (slot.preprocess, slot.postprocess) for name, slot in setup.slots.items()}
        self.slots = SimSlots(initial, specs, plan.unhealthy)
        self.journal = JobJournal()
        self.builds = BuildCounters()
        #: Unix time the device last came up (a restart included).
        self.up_since: float | None = None
        self.device: SimDevice | None = None
        self.started = False
        #: Starts after the first (each one a simulated agent restart over the same state directory).
        self.restarts = 0
        self.next_telemetry = 0.0

    def should_run(self, since_start: float) -> bool:
        return not any(w.start_s <= since_start < w.end_s for w in self.plan.offline)


class SimWorker:
    """Runs ``plans`` until ``stop`` is set; ``t0`` (Unix time) is when the whole simulator started."""

    def __init__(
        self,
        plans: list[DevicePlan],
        setup: FleetSetup,
        *,
        worker: int,
        t0: float,
        telemetry_s: float = 10.0,
        upgrade_at_s: float | None = None,
        report_s: float = REPORT_EVERY_S,
    ) -> None:
        self.setup = setup
        self.worker = worker
        self.t0 = t0
        #: Devices switched on this many seconds after ``t0`` or later run the upgraded platform.
        self.upgrade_at_s = upgrade_at_s
        self.telemetry_s = telemetry_s
        self.report_s = report_s
        self.members = [_Member(plan, setup) for plan in plans]
        self._stoppers: list[threading.Thread] = []
        self._rng = random.Random(worker)

    def run(self, stop: threading.Event) -> None:
        """Start, keep the devices as their plans say until ``stop``, stop them all, write the report."""
        next_report = 0.0
        try:
            while not stop.is_set():
                now = time.time()
                self._apply_windows(now - self.t0)
                self._telemetry(now)
                if now >= next_report:
                    next_report = now + self.report_s
                    self.write_report()
                stop.wait(TICK_S)
        finally:
            for member in self.members:
                self._switch_off(member)
            for thread in self._stoppers:
                thread.join(_STOP_TIMEOUT_S + 1.0)
            self.write_report()

    def _apply_windows(self, since_start: float) -> None:
        for member in self.members:
            wanted = member.should_run(since_start)
            if wanted and member.device is None:
                self._switch_on(member)
            elif not wanted and member.device is not None:
                self._switch_off(member)

    def _switch_on(self, member: _Member) -> None:
        upgraded = self.upgrade_at_s is not None and time.time() - self.t0 >= self.upgrade_at_s
        device = SimDevice(
            member.plan, self.setup, member.slots, member.journal, counters=member.builds, upgraded=upgraded
        )
        try:
            device.start()
        except Exception:
            log.exception("fleetsim.device.start_failed", device=member.plan.device_id)
            device.stop(0.5)
            return
        member.device = device
        member.up_since = time.time()
        member.restarts += member.started
        member.started = True
        member.next_telemetry = time.time() + self._rng.uniform(0.0, self.telemetry_s)

    def _switch_off(self, member: _Member) -> None:
        device, member.device = member.device, None
        if device is None:
            return
        log.info("fleetsim.device.off", device=member.plan.device_id)
        # Stops take seconds (flush, offline status): in parallel, off the control loop.
        thread = threading.Thread(target=device.stop, args=(_STOP_TIMEOUT_S,), daemon=True)
        thread.start()
        self._stoppers = [t for t in self._stoppers if t.is_alive()] + [thread]

    def _telemetry(self, now: float) -> None:
        for member in self.members:
            device = member.device
            if device is None or now < member.next_telemetry:
                continue
            member.next_telemetry = now + self.telemetry_s
            try:
                device.publish_telemetry()
            except Exception:  # one device's sample must not stop the others'
                log.exception("fleetsim.telemetry.failed", device=member.plan.device_id)

    def report(self) -> dict[str, Any]:
        """This worker's report (see the module docstring)."""
        devices = {}
        for member in self.members:
            slots = {}
            for name in member.slots.names():
                model, _since = member.slots.current(name)
                slots[name] = f"{model.model_id}:{model.version}" if model else None
            device = member.device
            devices[member.plan.device_id] = {
                "online": bool(device is not None and device.link.connected),
                "running": device is not None,
                "restarts": member.restarts,
                "unhealthy": member.plan.unhealthy,
                "slots": slots,
                # Chunk replies the link's inbox had no room for (this run of the device only).
                "inbox_dropped": device.link.counter("inbox_dropped") if device is not None else 0,
                **member.journal.snapshot(),
            }
            if self.setup.build_seconds > 0:
                devices[member.plan.device_id]["engines"] = self._engines(member)
        times = os.times()
        return {
            "worker": self.worker,
            "pid": os.getpid(),
            "updated": time.time(),
            "cpu_s": round(times.user + times.system, 3),
            "rss_mb": round(_proc_status_mb("VmRSS"), 1),
            "peak_rss_mb": round(_proc_status_mb("VmHWM"), 1),
            "threads": threading.active_count(),
            "fds": len(os.listdir("/proc/self/fd")) if Path("/proc/self/fd").is_dir() else None,
            "devices": devices,
        }

    @staticmethod
    def _engines(member: _Member) -> dict[str, Any]:
        """The device's engine figures (agent/fleetsim/build.py), what it runs on, and what it serves."""
        device = member.device
        builds = device.builds if device is not None else None
        return {
            **member.builds.snapshot(),
            "platform": None
            if device is None
            else f"{device.platform.device_model} JetPack {device.platform.jetpack}",
            "serving": {n: builds.serving(n) for n in member.slots.names()} if builds is not None else {},
            "up_since": member.up_since,
        }

    def write_report(self) -> None:
        atomic_write_json(report_path(self.setup.state_dir, self.worker), self.report())
