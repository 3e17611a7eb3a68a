"""A rollout rig for fault tests: a private mosquitto, a simulated fleet, the controller as a child
process, and a probe that sees every desired state and job status on the broker.

Real parts throughout: the controller is ``python -m agent fleet controller`` (SIGKILLed, SIGTERMed
and restarted like a systemd unit would), the devices are :mod:`agent.fleetsim` (the agent's own
link, spool, ledger and delivery service; only the model loop is a stand-in), the broker is
mosquitto, killed and restarted on its own port, with or without persistence.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agent.demo.broker import Broker
from agent.demo.modelzoo import write_classifier
from agent.errors import TransportError
from agent.fleet.controller.client import ControllerClient
from agent.fleet.deploy.keys import KeyPairFiles, write_keypair
from agent.fsutil import sha256_file
from agent.mqtt.settings import MqttSettings
from agent.protocol.manifest import recover_job_id
from agent.protocol.messages import JobStatus, decode
from tests.fleetsim.sim_fleet import SimFleet
from tests.mqtt_probe import Probe, Received
from tests.waiting import patient, wait_until

SLOT = "main"
#: How long a rollout of the rig's small fleet may take, faults and restarts included.
ROLLOUT_TIMEOUT_S = 180.0


class ControllerRig:
    """Everything one fault test needs; ``close()`` stops it all (the broker last)."""

    def __init__(
        self,
        root: Path,
        *,
        devices: int,
        prefix: str,
        persistence: bool = False,
        unhealthy: Sequence[str] = (),
        fleet_args: Sequence[str] = (),
    ) -> None:
        self.root = root
        self.prefix = prefix
        extra = ["log_type debug"]  # "Received PUBLISH from ..." lines: the broker's count of sends
        if persistence:
            extra += ["persistence true", f"persistence_location {root / 'broker'}/", "autosave_interval 1"]
        self.broker = Broker(root / "broker", extra)
        self.broker.start()
        self.keys: KeyPairFiles = write_keypair(root / "keys", "faults")
        self.v1 = write_classifier(root / "cls-1.onnx", input_size=32, num_classes=4, seed=1)
        self.v2 = write_classifier(root / "cls-2.onnx", input_size=32, num_classes=4, seed=2)
        self.settings = MqttSettings(
            host=self.broker.host,
            port=self.broker.port,
            prefix=prefix,
            reconnect_min_s=0.1,
            reconnect_max_s=0.5,
        )
        self.probe = Probe(self.broker.host, self.broker.port)
        self.probe.subscribe(f"{prefix}/+/down/desired/{SLOT}", qos=1)
        self.probe.subscribe(f"{prefix}/+/up/jobs/+", qos=1)
        self.config = self._write_config()
        self.log = root / "controller.log"
        self.controller: subprocess.Popen[bytes] | None = None
        self.fleet = SimFleet(
            root,
            self.broker,
            self.keys,
            prefix,
            devices=devices,
            procs=1,
            model=self.v1,
            extra=[*(f"--unhealthy={u}" for u in unhealthy), *fleet_args],
        )
        self.ids = self.fleet.ids
        self.spawn()  # while the simulator's devices come up: neither waits for the other
        self.fleet.wait_online(timeout=60)

    def _write_config(self) -> Path:
        state = self.root / "controller"
        config = self.root / "controller.yaml"
        config.write_text(
            f"mqtt: {{host: {self.broker.host}, port: {self.broker.port}, prefix: {self.prefix}, "
            "reconnect_min_s: 0.1, reconnect_max_s: 0.5}\n"
            f"state_dir: {state}\nsigning_key: {self.keys.private}\nkey_id: {self.keys.key_id}\n"
            "status_poll_s: 1\nselect_wait_s: 0.5\n"
        )
        return config

    # -- the controller ----------------------------------------------------------------------------

    def spawn(self) -> None:
        """Start the controller and wait for its ready line."""
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
        mark = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as out:
            child = subprocess.Popen(
                [sys.executable, "-m", "agent", "fleet", "controller", "--config", str(self.config)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.controller = child
        wait_until(
            lambda: b"requests on" in self.log.read_bytes()[mark:] or child.poll() is not None,
            timeout=60,
            what="the controller's ready line",
        )
        assert child.poll() is None, self.log.read_text(errors="replace")[-3000:]

    def signal_controller(self, signum: signal.Signals) -> None:
        """Send ``signum`` to the controller and wait for it to exit (a SIGTERM stops it cleanly)."""
        assert self.controller is not None
        self.controller.send_signal(signum)
        self.controller.wait(patient(30))
        if signum is signal.SIGTERM:
            assert self.controller.returncode == 0, self.log.read_text(errors="replace")[-3000:]

    # -- the rollout ---------------------------------------------------------------------------------

    def start(self, body: dict[str, Any], *, old: bool = False) -> dict[str, Any]:
        """Start a rollout of v2 (v1 with ``old``; uploaded first) on every device; the answer."""
        model = self.v1 if old else self.v2
        request = {
            "model_sha256": sha256_file(model),
            "model_name": "cls.onnx",
            "model_id": "cls",
            "slot": SLOT,
            "version": "1" if old else "2",
            "devices": list(self.ids),
            **body,
        }
        with ControllerClient(self.settings, timeout=30) as client:
            return client.start(request, model)

    def status(self, rollout_id: str) -> dict[str, Any]:
        """The rollout's status; asked again while the controller is not subscribed (a request sent
        before it resubscribed to a restarted broker has no one to reach, as for any CLI call)."""
        # Until a deadline, not a count of tries: a request nobody is subscribed to (mosquitto's "no
        # matching subscribers") or a broker still down fails at once, not after the timeout.
        deadline = time.monotonic() + patient(60.0)
        while time.monotonic() < deadline:
            try:
                with ControllerClient(self.settings, timeout=10) as client:
                    return client.request("status", {"rollout_id": rollout_id})
            except TransportError:  # ControllerUnavailableError, or the broker not back yet
                time.sleep(0.2)
        raise AssertionError(
            f"no controller answered for a minute: {self.log.read_text(errors='replace')[-3000:]}"
        )

    def wait_status(
        self, rollout_id: str, done: Callable[[dict[str, Any]], bool], what: str
    ) -> dict[str, Any]:
        seen: dict[str, Any] = {}

        def reached() -> bool:
            seen.clear()
            seen.update(self.status(rollout_id))
            if done(seen):
                return True
            time.sleep(0.2)
            return False

        wait_until(reached, timeout=ROLLOUT_TIMEOUT_S, what=what)
        return seen

    def wait_final(self, rollout_id: str) -> dict[str, Any]:
        """The rollout's status once it ended and any rollback it asked for was followed to its end."""

        def over(status: dict[str, Any]) -> bool:
            if status["state"] == "ABORTED" and status.get("rollback") is not None:
                return status["rollback"].get("ends") is not None
            return bool(status["state"] in ("DONE", "ABORTED", "SUPERSEDED"))

        return self.wait_status(rollout_id, over, f"rollout {rollout_id} over")

    # -- what the broker saw -----------------------------------------------------------------------

    def desired(self, job_id: str) -> Counter[str]:
        """Publishes of ``job_id``'s desired state per device, as the probe received them live."""
        return Counter(
            m.topic.split("/")[-4]
            for m in self.probe.snapshot()
            if "/down/desired/" in m.topic and not m.retain and recover_job_id(m.payload) == job_id
        )

    def job_states(self, job_id: str) -> list[tuple[str, str]]:
        """(device, state) of every job status of ``job_id`` the probe received."""
        return [
            (m.topic.split("/")[-4], decode(JobStatus, m.payload).state.value)
            for m in self.probe.snapshot()
            if m.topic.endswith(f"/up/jobs/{job_id}")
        ]

    def wait_probe(self, predicate: Callable[[list[Received]], bool], what: str) -> None:
        wait_until(lambda: predicate(self.probe.snapshot()), timeout=ROLLOUT_TIMEOUT_S, what=what)

    def broker_publishes(self) -> Counter[str]:
        """Desired-state publishes per device the broker received, from its own log (every run)."""
        topic = f"'{re.escape(self.prefix)}/([^/]+)/down/desired/{SLOT}'"
        pattern = re.compile(rf"Received PUBLISH from \S+ \(d\d, q\d, r\d, m\d+, {topic}")
        return Counter(pattern.findall(self.broker.log()))

    def wait_devices(self, predicate: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
        """The simulator's report once ``predicate`` holds for its devices."""
        wait_until(lambda: predicate(self.fleet.report()["devices"]), timeout=ROLLOUT_TIMEOUT_S, what=what)
        return dict(self.fleet.report()["devices"])

    def close(self) -> None:
        if self.controller is not None and self.controller.poll() is None:
            self.controller.send_signal(signal.SIGTERM)
            try:
                self.controller.wait(patient(30))
            except subprocess.TimeoutExpired:
                self.controller.kill()
                self.controller.wait()
        self.fleet.stop()
        self.probe.close()
        self.broker.kill()
