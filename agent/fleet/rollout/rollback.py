"""Moving an aborted rollout's devices back to the model each ran before.

Which devices: every device of the rollout that may run the new model: its desired state was sent
and its job ended ``ACTIVE``, or had not ended (it may still go ``ACTIVE``: a canary in probation
when another canary tripped the gate). Devices whose job failed, was refused or rolled back
themselves already run their previous model.

How, by what the controller knows of a device's previous model (read from its ``up/info`` when the
rollout was created):

- **A model an earlier rollout of this store deployed**: a new signed desired state for it (that
  rollout's manifest fields, a new job id, a higher sequence), published retained. It supersedes a
  job still in flight, and a device offline now gets it when it comes back. The devices are grouped
  by previous model; each group is logged (job id, sequence) *before* it is published, so a restarted
  controller publishes the same one again, not a second.
- **A model this controller never deployed** (installed by hand, by ``fleet deploy``, or at the
  device's first start): the device's own ``rollback`` command, which puts back its last-known-good
  model. The rollout's desired state is followed for these devices until their job ends; one that ends
  ``ACTIVE`` gets the command, once (logged before it is sent: never twice, even across a restart);
  one that ends otherwise needs none. The retained desired state stays, but its job id has ended on
  the device, which does not start it again. A device offline past the wave timeout is listed.
- **No previous model** (the slot was empty): nothing to go back to; listed.

When every group and every command has ended (or the wave timeout has passed), ``rollback_done`` is
logged with each device's end; ``fleet rollout status`` shows the counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import structlog

from agent.errors import AgentError
from agent.fleet.deploy.plan import DeployPlan, next_sequence
from agent.fleet.deploy.run import FleetDeploy
from agent.fleet.devices.command import is_running, send_command
from agent.fleet.rollout.gate import DeviceEnd
from agent.fleet.rollout.records import DeviceStep
from agent.fleet.rollout.spec import RolloutRequest, plan_for, ref_sha256, request_of, way_back
from agent.fleet.rollout.store import RolloutStore
from agent.mqtt.settings import MqttSettings
from agent.protocol.messages import JobState
from agent.signing import Ed25519PrivateKey

log = structlog.get_logger(__name__)

#: Ends of a device that may run the new model: a rollback moves it back.
MAY_RUN_NEW = frozenset({DeviceEnd.ACTIVE, DeviceEnd.PENDING, DeviceEnd.TIMED_OUT, DeviceEnd.SKIPPED})
#: Seconds to wait for one device's reply to the ``rollback`` command.
_COMMAND_TIMEOUT_S = 10.0


def deployed_requests(store: RolloutStore, slot: str) -> dict[str, RolloutRequest]:
    """By model SHA-256: the request of the newest rollout of this store that deployed it on ``slot``."""
    found: dict[str, RolloutRequest] = {}
    for row in reversed(store.rollouts(limit=10_000)):  # oldest first: the newest wins
        sha = row.spec.get("request", {}).get("model_sha256")
        if row.slot == slot and sha:
            found[str(sha)] = request_of(row.spec)
    return found


class Rollback:
    """The rollback of one aborted rollout (see the module docstring); ``step`` until it returns True."""

    def __init__(
        self,
        store: RolloutStore,
        rollout_id: str,
        request: RolloutRequest,
        *,
        job_id: str,
        sequence: int,
        settings: MqttSettings,
        model_path: Callable[[str], Path],
        http_url: Callable[[str], str | None],
        signing_key: Ed25519PrivateKey | None,
        key_id: str | None,
        options: Mapping[str, Any],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.rollout_id = rollout_id
        self.request = request
        self.job_id = job_id
        self.sequence = sequence
        self.settings = settings
        self._model_path = model_path
        self._http_url = http_url
        self._key = signing_key
        self._key_id = key_id
        self._options = {k: v for k, v in options.items() if k != "on_change"}
        self._clock = clock
        self._deploys: dict[str, tuple[FleetDeploy, float]] = {}  # rollback job id -> deploy, since
        self._follow: tuple[FleetDeploy, float] | None = None
        self._events: list[tuple[str, dict[str, Any]]] | None = None
        self._previous: dict[str, RolloutRequest] | None = None
        self.done = False

    # -- the loop ------------------------------------------------------------------------------------

    def step(self) -> bool:
        """Do what is due; True once every device of the rollback has ended (or timed out)."""
        if self.done:
            return True
        events = self._log()
        if any(what == "rollback_done" for what, _ in events):
            self.done = True
            return True
        if not any(what in ("rollback", "rollback_by_command", "rollback_none") for what, _ in events):
            self._plan()  # its notes land in the same list
        groups = [detail for what, detail in events if what == "rollback"]
        by_command = [
            d for what, detail in events if what == "rollback_by_command" for d in detail["devices"]
        ]
        commanded = {str(detail["device"]): detail for what, detail in events if what == "rollback_command"}
        for detail in groups:
            if str(detail["job_id"]) not in self._deploys:  # a publish that failed is tried again
                self._deploys[str(detail["job_id"])] = (self._publish(detail), self._clock())
        over = True
        for deploy, since in self._deploys.values():
            deploy.poll(0.0)
            over = over and (deploy.finished or self._timed_out(since))
        if by_command:
            over = self._command(by_command, commanded) and over
        if not over:
            return False
        self._finish()
        return True

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for news from the devices being moved back."""
        running = [d for d, _ in self._deploys.values()] + ([self._follow[0]] if self._follow else [])
        if running:
            running[0].poll(timeout)
        else:
            time.sleep(timeout)

    def stop(self) -> None:
        for deploy, _ in self._deploys.values():
            deploy.stop()
        if self._follow is not None:
            self._follow[0].stop()
        self._deploys, self._follow = {}, None

    def _timed_out(self, since: float) -> bool:
        return self._clock() - since >= self.request.wave_timeout_s

    def _plan_for(
        self, request: RolloutRequest, devices: tuple[str, ...], job_id: str, sequence: int
    ) -> DeployPlan:
        sha = request.model_sha256
        # The calibration goes back with its model: it is part of the manifest a release binds.
        calib = request.calib_sha256
        return plan_for(
            request,
            self._model_path(sha),
            devices,
            job_id=job_id,
            sequence=sequence,
            http_url=self._http_url(sha),
            calib_cache=self._model_path(calib) if calib else None,
            calib_http_url=self._http_url(calib) if calib else None,
        )

    # -- planning ------------------------------------------------------------------------------------

    def _plan(self) -> None:
        """Sort the devices to move back by what is known of their previous model; log the plan."""
        by_sha: dict[str, list[str]] = {}
        by_command: list[str] = []
        none: list[str] = []
        for row in self.store.devices(self.rollout_id):
            if row.step not in (DeviceStep.SENDING, DeviceStep.SENT, DeviceStep.ENDED):
                continue
            if row.step is DeviceStep.ENDED and row.end not in MAY_RUN_NEW:
                continue  # it failed, was refused or rolled back itself: it runs its previous model
            sha = ref_sha256(row.from_version)
            if sha is None:
                none.append(row.device)
            elif self._previous_request(sha) is None:
                by_command.append(row.device)
            else:
                by_sha.setdefault(sha, []).append(row.device)
        for sha, devices in sorted(by_sha.items()):
            job_id = f"{self.rollout_id}-rollback-{sha[:8]}"
            self._note(
                "rollback",
                sha256=sha,
                devices=devices,
                job_id=job_id,
                sequence=next_sequence(),
            )
        if by_command:
            self._note(
                "rollback_by_command",
                devices=by_command,
                why="no rollout of this controller deployed their previous model: the device's own "
                "rollback command puts back its last-known-good model",
            )
        self._note("rollback_none", devices=none, why="no previous model in the slot")
        log.info(
            "fleet.rollout.rollback_planned",
            rollout=self.rollout_id,
            by_desired_state=sum(len(v) for v in by_sha.values()),
            by_command=len(by_command),
            no_previous=len(none),
        )

    def _previous_request(self, sha256: str) -> RolloutRequest | None:
        """The request of the (newest) rollout that deployed ``sha256`` on this slot, read once."""
        if self._previous is None:
            self._previous = deployed_requests(self.store, self.request.slot)
        return self._previous.get(sha256)

    def _log(self) -> list[tuple[str, dict[str, Any]]]:
        """The rollout's events, read from the store once; this object's own notes are appended."""
        if self._events is None:
            self._events = self.store.events(self.rollout_id)
        return self._events

    def _note(self, what: str, **detail: Any) -> None:
        self.store.note(self.rollout_id, what, **detail)
        self._log().append((what, detail))

    # -- by desired state ----------------------------------------------------------------------------

    def _publish(self, detail: Mapping[str, Any]) -> FleetDeploy:
        previous = self._previous_request(str(detail["sha256"]))
        assert previous is not None  # planned only for known models
        plan = way_back(
            self._plan_for(previous, tuple(detail["devices"]), str(detail["job_id"]), int(detail["sequence"]))
        )
        # The previous model's own release goes with it: a device with a fleet root refuses a way back
        # that names none, as it refuses any desired state.
        deploy = FleetDeploy(
            self.settings,
            plan,
            signing_key=self._key,
            key_id=self._key_id,
            release=previous.release,
            **self._options,
        )
        deploy.start()
        log.info(
            "fleet.rollout.rollback_sent", rollout=self.rollout_id, devices=len(plan.devices), job=plan.job_id
        )
        return deploy

    # -- by command ----------------------------------------------------------------------------------

    def _command(self, devices: list[str], commanded: Mapping[str, Any]) -> bool:
        """Follow the rollout's job on ``devices``; ``rollback`` each that ended ACTIVE. True: over."""
        waiting = [d for d in devices if d not in commanded]
        if not waiting:
            return True
        if self._follow is None:
            plan = self._plan_for(self.request, tuple(waiting), self.job_id, self.sequence)
            deploy = FleetDeploy(
                self.settings,
                plan,
                signing_key=self._key,
                key_id=self._key_id,
                release=self.request.release,
                **self._options,
            )
            deploy.start()  # the same desired state again: devices that have it see the same job
            self._follow = (deploy, self._clock())
        deploy, since = self._follow
        deploy.poll(0.0)
        for p in deploy.snapshot():
            if p.device in commanded or p.state is None or not p.state.terminal:
                continue
            if p.state is not JobState.ACTIVE:
                self._note("rollback_command", device=p.device, end=f"not needed: {p.state.value}")
                continue
            # Logged before it is sent: a restart never sends a device's rollback twice.
            self._note("rollback_command", device=p.device, end="SENT")
            self._send_rollback(p.device)
        left = [p.device for p in deploy.snapshot() if p.state is None or not p.state.terminal]
        return not left or self._timed_out(since)

    def _send_rollback(self, device: str) -> None:
        try:
            # Followed briefly: the controller's loop must not wait out a device's engine rebuild.
            reply = send_command(
                self.settings,
                device,
                "rollback",
                {"slot": self.request.slot},
                timeout=_COMMAND_TIMEOUT_S,
                follow_s=_COMMAND_TIMEOUT_S,
            )
            if is_running(reply):
                end = "ROLLING_BACK: still running on the device (its up/info shows the model it ends on)"
            else:
                end = "ROLLED_BACK" if reply.ok else f"refused: {reply.error_code}"
        except AgentError as exc:
            end = f"no reply: {exc.code}"
        self._note("rollback_command_reply", device=device, end=end)
        log.info("fleet.rollout.rollback_command", rollout=self.rollout_id, device=device, end=end)

    # -- the end -------------------------------------------------------------------------------------

    def _finish(self) -> None:
        ends: dict[str, str] = {}
        for deploy, _ in self._deploys.values():
            for p in deploy.snapshot():
                ends[p.device] = p.state.value if p.state is not None else "PENDING"
        events = self._log()
        for what, detail in events:
            if what in ("rollback_command", "rollback_command_reply"):
                ends[str(detail["device"])] = str(detail["end"])
        for what, detail in events:
            if what == "rollback_by_command":
                for device in detail["devices"]:
                    ends.setdefault(str(device), "PENDING")  # still working at the wave timeout
        self.stop()
        self._note("rollback_done", ends=ends)
        self.done = True
        log.info("fleet.rollout.rolled_back", rollout=self.rollout_id, devices=len(ends))
