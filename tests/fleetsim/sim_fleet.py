"""A fleet simulator child process for tests (``python -m agent.fleetsim``), and its report."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent.demo.broker import Broker
from agent.fleet.deploy.keys import KeyPairFiles
from agent.fleetsim.launcher import read_reports
from agent.fleetsim.plan import device_ids
from tests.waiting import patient, wait_until


class SimFleet:
    """``devices`` simulated devices under ``prefix`` in their own processes; ``stop()`` ends them."""

    def __init__(
        self,
        root: Path,
        broker: Broker,
        keys: KeyPairFiles,
        prefix: str,
        *,
        devices: int,
        procs: int = 2,
        model: Path | None = None,
        extra: Sequence[str] = (),
    ) -> None:
        self.state_dir = root / "sim"
        self.ids = device_ids(devices)
        command = [
            sys.executable,
            "-m",
            "agent.fleetsim",
            "--broker",
            f"{broker.host}:{broker.port}",
            "--prefix",
            prefix,
            "--devices",
            str(devices),
            "--procs",
            str(procs),
            "--trust",
            str(keys.public),
            "--key-id",
            keys.key_id,
            "--state-dir",
            str(self.state_dir),
            "--telemetry-s",
            "1",
            # Every wait for the devices' state reads these reports: rewritten each tick (0.5 s),
            # a wait for a fresh one ends a second and a half sooner than at the default 2 s.
            "--report-s",
            "0.5",
            # A chunk asked of a controller that was stopped (the fault tests) is asked again after
            # 1, 2, 4 ... s rather than 5, 10 ... s: the restarted controller is asked seconds sooner.
            "--chunk-timeout-s",
            "1",
            *(["--model", f"main={model}:cls:1"] if model is not None else []),
            *extra,
        ]
        self.log = (root / "fleetsim.log").open("wb")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)

    def report(self) -> dict[str, Any]:
        """The workers' reports merged (rewritten by each worker every 0.5 s)."""
        return read_reports(self.state_dir)

    def device(self, device: str) -> dict[str, Any]:
        entry: dict[str, Any] = self.report()["devices"].get(device, {})
        return entry

    def wait_online(self, devices: Sequence[str] | None = None, timeout: float = 30.0) -> None:
        wanted = set(self.ids if devices is None else devices)

        def online() -> bool:
            found = self.report()["devices"]
            return all(found.get(d, {}).get("online") for d in wanted)

        wait_until(online, timeout, f"{len(wanted)} simulated devices online")

    def wait_report_after(self, moment: float, timeout: float = 15.0) -> dict[str, Any]:
        """A merged report every worker wrote after ``moment`` (Unix time)."""

        def fresh() -> bool:
            workers = self.report()["workers"]
            return bool(workers) and all(w["updated"] > moment for w in workers)

        wait_until(fresh, timeout, "fresh simulator reports")
        return self.report()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=patient(40))
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
