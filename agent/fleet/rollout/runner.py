"""One rollout driven from its stored state: waves started in order, their jobs followed, the gate
judged, soaks waited out, an abort (tripped or asked for) carried out with the rollback it asks for.

:meth:`RolloutRunner.step` does what is due and returns; the controller calls it for every open
rollout in its loop, ``fleet deploy`` calls it for its one-wave rollout. Nothing that matters lives
only in this object: each decision is written to the :class:`~agent.fleet.rollout.store.RolloutStore`
before (``SENDING``) or after (``SENT``, a job's end, a wave's verdict) it takes effect, so a new
runner on the same store, in a restarted controller, carries on where the killed one stopped.

A wave is one :class:`~agent.fleet.deploy.run.FleetDeploy`: the same signed desired state (the rollout's
job id and manifest sequence, fixed when it was created) published retained to the wave's devices,
their job states followed, quiet devices asked with ``status``. After a restart the wave's unended
devices get the same desired state again: a device that has it sees the same job (one terminal state
per job id), not a second one; one whose job ended meanwhile says so when asked.

Rollback on abort publishes, to every device of the rollout that may run the new model (its job
ended ACTIVE, or had not ended), a new signed desired state for the model it ran before (read from
its retained ``up/info`` when the rollout was created), with a new job id and a higher sequence:
retained, so a device offline at that moment also ends on its previous model when it comes back.
The previous model's manifest comes from the rollout that put it there (the controller's store);
a device whose previous model no rollout of this store deployed is listed, not guessed at.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import structlog

from agent.fleet.deploy.manifest import plan_manifest
from agent.fleet.deploy.outcome import DeviceProgress
from agent.fleet.deploy.run import FleetDeploy
from agent.fleet.rollout.gate import DeviceEnd, DeviceReport, WaveVerdict, judge_wave
from agent.fleet.rollout.precision import end_note, precision_summary, runs_of_figures, stored_runs
from agent.fleet.rollout.records import DeviceRow, DeviceStep, RolloutState, WaveState
from agent.fleet.rollout.rollback import Rollback
from agent.fleet.rollout.spec import plan_for, request_of, wheel_files
from agent.fleet.rollout.store import RolloutStore
from agent.mqtt.settings import MqttSettings
from agent.protocol.manifest import DeployManifest
from agent.protocol.messages import ProbationFigures, ShadowFigures
from agent.signing import Ed25519PrivateKey

log = structlog.get_logger(__name__)

#: Rollout states after which nothing but a rollback remains to be done.
FINAL_STATES = frozenset({RolloutState.DONE, RolloutState.ABORTED, RolloutState.SUPERSEDED})


#: What the store keeps of a job's figures, all of which the device chose: probation figures per
#: map (baseline, current) and the characters of a name or code. The gate reads ``failed`` and the
#: shadow numbers, which are kept whole; the maps are for people (console, ``status --json``).
STORED_FIGURES = 64
STORED_NAME_CHARS = 128


def job_figures(p: DeviceProgress) -> dict[str, Any]:
    """The job figures the rollout store keeps for ``p``: bounded in count and bytes (the
    rule for everything a device sends that the operator side keeps), the gate's inputs intact."""
    figures: dict[str, Any] = {"state": p.state.value if p.state else None}
    if p.error_code:
        figures["error_code"] = p.error_code[:STORED_NAME_CHARS]
    if p.shadow is not None:
        figures["shadow"] = p.shadow.model_dump(mode="json")  # numbers only
    if p.probation is not None:
        probation = p.probation.model_dump(mode="json")
        for part in ("baseline", "current"):
            kept = list(probation.get(part, {}).items())[:STORED_FIGURES]
            probation[part] = {name[:STORED_NAME_CHARS]: value for name, value in kept}
        if probation.get("failed"):
            probation["failed"]["figure"] = probation["failed"]["figure"][:STORED_NAME_CHARS]
        figures["probation"] = probation
    if p.runs is not None:
        figures["runs"] = stored_runs(p.runs)
    return figures


def _report_of_row(row: DeviceRow, online: bool = True) -> DeviceReport:
    figures = row.figures or {}
    shadow = figures.get("shadow")
    probation = figures.get("probation")
    return DeviceReport(
        row.device,
        row.end if row.step is DeviceStep.ENDED and row.end is not None else DeviceEnd.PENDING,
        started=bool(figures.get("state")),
        online=online,
        shadow=None if shadow is None else ShadowFigures.model_validate(shadow),
        probation=None if probation is None else ProbationFigures.model_validate(probation),
        runs=runs_of_figures(figures),
    )


class RolloutRunner:
    """Drives the stored rollout ``rollout_id`` (see the module docstring)."""

    def __init__(
        self,
        store: RolloutStore,
        rollout_id: str,
        *,
        settings: MqttSettings,
        model_path: Callable[[str], Path],
        signing_key: Ed25519PrivateKey | None,
        key_id: str | None,
        http_url: Callable[[str], str | None] = lambda sha256: None,
        deploy_options: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``model_path(sha256)`` finds a model's bytes, ``http_url(sha256)`` its HTTP source (or None).

        ``deploy_options`` go to every :class:`FleetDeploy` (``serve``, ``on_change``, ...).
        """
        self.store = store
        self.rollout_id = rollout_id
        self.settings = settings
        self._model_path = model_path
        self._http_url = http_url
        self._key = signing_key
        self._key_id = key_id
        self._options = dict(deploy_options or {})
        self._clock = clock
        row = store.rollout(rollout_id)
        self.request = request_of(row.spec)
        self._policy = self.request.policy()
        self._manifest: DeployManifest | None = None  # the rollout's desired state, built at its first wave
        #: The earlier waves' reports, for the wave they were read for (those waves no longer change).
        self._earlier_reports: tuple[int, list[DeviceReport]] | None = None
        self._wants: bool | None = None  # whether an abort asks for a rollback, once known
        self.sequence = int(row.spec["sequence"])
        self.job_id = row.job_id
        #: The running wave's deploy (None between waves), and which wave it is.
        self.deploy: FleetDeploy | None = None
        #: The latest wave's deploy, kept after the wave ended (``fleet deploy`` reports from it).
        self.last_deploy: FleetDeploy | None = None
        self._wave: int | None = None
        self._republished = 0  # the running deploy's re-publishes counted in the store so far
        self._recorded: dict[str, str] = {}
        #: The devices that had not started when a wave timed out, for that wave (see _mark_late).
        self._not_started: tuple[int, frozenset[str]] | None = None
        self._rollback: Rollback | None = None

    # -- the loop ------------------------------------------------------------------------------------

    def step(self) -> bool:
        """Do what is due now; True once the rollout (and any rollback it asked for) is over."""
        row = self.store.rollout(self.rollout_id)
        if row.state in FINAL_STATES:
            self._close_wave()
            if row.state is RolloutState.ABORTED and self._wants_rollback():
                if self._rollback is None:
                    self._rollback = Rollback(
                        self.store,
                        self.rollout_id,
                        self.request,
                        job_id=self.job_id,
                        sequence=self.sequence,
                        settings=self.settings,
                        model_path=self._model_path,
                        http_url=self._http_url,
                        signing_key=self._key,
                        key_id=self._key_id,
                        options=self._options,
                        clock=self._clock,
                    )
                return self._rollback.step()
            return True
        waves = self.store.wave_rows(self.rollout_id)
        current = next((w for w in waves if w.state in (WaveState.RUNNING, WaveState.SOAKING)), None)
        if current is None:
            if row.state is RolloutState.PAUSED:
                return False
            upcoming = next((w for w in waves if w.state is WaveState.WAITING), None)
            if upcoming is None:
                self.store.set_state(self.rollout_id, RolloutState.DONE, self._done_reason())
                log.info("fleet.rollout.done", rollout=self.rollout_id)
                return True
            self.store.set_wave(self.rollout_id, upcoming.index, WaveState.RUNNING, reason="started")
            log.info("fleet.rollout.wave", rollout=self.rollout_id, wave=upcoming.index, state="RUNNING")
            waves = self.store.wave_rows(self.rollout_id)
            current = waves[upcoming.index]
        if self._wave != current.index:
            self._open_wave(current.index)
        if self.deploy is not None:
            self.deploy.poll(0.0)
            self._count_republished(self.deploy)
        # One snapshot for both: a job that ends between two snapshots would be judged ended
        # without its end ever being stored.
        snapshot = self.deploy.snapshot() if self.deploy is not None else []
        self._record(snapshot)
        started = current.started_at or self._clock()
        timed_out = self._clock() - started >= self.request.wave_timeout_s
        reports = self._reports(current.index, snapshot)
        if timed_out:
            reports = self._mark_late(current.index, reports)
        verdict = judge_wave(reports, self._earlier(current.index), self._policy, timed_out=timed_out)
        self._record_timeouts(reports, verdict)
        if verdict.gate == "trips":
            self._trip(current.index, verdict)
            return False
        if not verdict.done:
            return False
        figures = asdict(verdict.figures)
        if current.state is WaveState.RUNNING and self.request.soak_s > 0:
            until = self._clock() + self.request.soak_s
            self.store.set_wave(
                self.rollout_id,
                current.index,
                WaveState.SOAKING,
                figures={**figures, "soak_until": until},
                reason=f"soaking {self.request.soak_s:g} s; {verdict.reason}",
            )
            return False
        if current.state is WaveState.SOAKING and self._clock() < float(
            (current.figures or {}).get("soak_until", 0)
        ):
            return False
        self.store.set_wave(
            self.rollout_id, current.index, WaveState.DONE, figures=figures, reason=verdict.reason
        )
        log.info(
            "fleet.rollout.wave",
            rollout=self.rollout_id,
            wave=current.index,
            state="DONE",
            why=verdict.reason,
        )
        self._close_wave()
        return False

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for news from the running wave's devices."""
        if self.deploy is not None:
            self.deploy.poll(timeout)
        elif self._rollback is not None:
            self._rollback.wait(timeout)
        else:
            time.sleep(timeout)

    def stop(self) -> None:
        """Disconnect the deploys (their retained desired states stay; the store holds the rest)."""
        self._close_wave()
        if self._rollback is not None:
            self._rollback.stop()

    # -- a wave --------------------------------------------------------------------------------------

    def _open_wave(self, index: int) -> None:
        """Publish wave ``index``'s desired state to its unended devices and follow them.

        The wave counts as open only once the publish went through: a broker that is down makes
        this raise, and the next step tries again (the devices stay SENDING: sent again, same job).
        """
        self._close_wave()
        rows = self.store.devices(self.rollout_id, wave=index)
        live = tuple(
            r.device for r in rows if r.step in (DeviceStep.PLANNED, DeviceStep.SENDING, DeviceStep.SENT)
        )
        if not live:
            self._wave = index
            return
        sha = self.request.model_sha256
        plan = plan_for(
            self.request,
            self._model_path(sha),
            live,
            job_id=self.job_id,
            sequence=self.sequence,
            http_url=self._http_url(sha),
            calib_cache=self._model_path(calib) if (calib := self.request.calib_sha256) else None,
            calib_http_url=self._http_url(calib) if calib else None,
            wheels=wheel_files(self.request, self._model_path),
        )
        if self._manifest is None:  # hashed once per runner, not at every wave
            self._manifest = plan_manifest(plan, self.job_id, self.sequence)
            if self._manifest.sha256 != sha:
                raise RuntimeError(
                    f"rollout {self.rollout_id}: model file for {sha} hashes to {self._manifest.sha256}"
                )
            artifacts = {a.sha256 for a in self._manifest.artifacts or ()}
            if self.request.calib_sha256 is not None and self.request.calib_sha256 not in artifacts:
                raise RuntimeError(
                    f"rollout {self.rollout_id}: calibration file for {self.request.calib_sha256} hashes "
                    f"to {sorted(artifacts)}"
                )
        deploy = FleetDeploy(
            self.settings,
            plan,
            signing_key=self._key,
            key_id=self._key_id,
            manifest=self._manifest,
            release=self.request.release,
            **self._options,
        )
        unsent = [r.device for r in rows if r.step in (DeviceStep.PLANNED, DeviceStep.SENDING)]
        try:
            for device in unsent:
                self.store.mark_sending(self.rollout_id, device)
            deploy.start()
            for device in unsent:
                self.store.mark_sent(self.rollout_id, device)
        except BaseException:
            # A write that failed (a full disk) or a broker that is down: the next step opens the
            # wave again, so this deploy's connection must not outlive the attempt.
            deploy.stop()
            raise
        # SENT devices were sent by an earlier runner (a controller that was restarted): published
        # again now, counted as such (SENDING ones counted themselves above).
        sent = [r.device for r in rows if r.step is DeviceStep.SENT]
        self.store.mark_resent(self.rollout_id, sent, "published again after a controller restart")
        self.deploy = self.last_deploy = deploy
        self._republished = 0
        self._wave = index
        log.info(
            "fleet.rollout.sent",
            rollout=self.rollout_id,
            wave=index,
            devices=len(live),
            resent=len(sent) + sum(1 for r in rows if r.step is DeviceStep.SENDING),
        )

    def _count_republished(self, deploy: FleetDeploy) -> None:
        """Count the wave's desired states the deploy published again after the broker came back."""
        if deploy.republished != self._republished:
            times, self._republished = deploy.republished - self._republished, deploy.republished
            devices = [p.device for p in deploy.snapshot() if not p.skipped] * times
            self.store.mark_resent(self.rollout_id, devices, "published again after a broker reconnect")

    def _close_wave(self) -> None:
        if self.deploy is not None:
            self.deploy.stop()
        self.deploy = None
        self._wave = None

    def _record(self, snapshot: list[DeviceProgress]) -> None:
        """Store each job state change of the wave's devices (a terminal one ends the device)."""
        for p in snapshot:
            if p.state is None or self._recorded.get(p.device) == p.state.value:
                continue
            self.store.record_job(self.rollout_id, p.device, DeviceEnd.of_job(p.state), job_figures(p))
            # Only once stored: a write that failed (a full disk) is tried again at the next step.
            self._recorded[p.device] = p.state.value

    def _reports(self, index: int, snapshot: list[DeviceProgress]) -> list[DeviceReport]:
        live = {p.device: p for p in snapshot}
        reports = []
        for row in self.store.devices(self.rollout_id, wave=index):
            if row.step is DeviceStep.CANCELLED:
                continue
            p = live.get(row.device)
            report = _report_of_row(row, online=p is None or p.online is not False)
            if row.step is not DeviceStep.ENDED and p is not None:
                if p.state is not None:
                    end = DeviceEnd.of_job(p.state)
                else:
                    # An unknown id the deploy does not wait for (``fleet deploy`` without --wait-unknown).
                    end = DeviceEnd.SKIPPED if p.skipped else DeviceEnd.PENDING
                report = DeviceReport(
                    row.device,
                    end,
                    started=p.state is not None or report.started,
                    online=p.online is not False,
                    shadow=p.shadow or report.shadow,
                    probation=p.probation or report.probation,
                    runs=p.runs or report.runs,
                )
            reports.append(report)
        return reports

    def _earlier(self, index: int) -> list[DeviceReport]:
        """Reports of the waves before ``index``: every one of their devices has ended, so they are
        read once per wave, not at every step."""
        if self._earlier_reports is None or self._earlier_reports[0] != index:
            reports = [
                _report_of_row(row)
                for row in self.store.devices(self.rollout_id)
                if row.wave < index and row.step is not DeviceStep.CANCELLED
            ]
            self._earlier_reports = (index, reports)
        return self._earlier_reports[1]

    def _mark_late(self, index: int, reports: list[DeviceReport]) -> list[DeviceReport]:
        """Mark ``late`` the devices of wave ``index`` that had not started when it timed out.

        Who had not started is fixed at the first step after the timeout and logged (a ``timeout``
        event), so a device that starts afterwards (``--on-timeout wait``) is waited for to its end,
        not taken for one stuck in its job at the timeout; a restarted controller reads the log.
        """
        if self._not_started is None or self._not_started[0] != index:
            logged = [
                detail
                for what, detail in self.store.events(self.rollout_id)
                if what == "timeout" and detail.get("wave") == index
            ]
            if logged:
                names = frozenset(str(d) for d in logged[-1].get("not_started", ()))
            else:
                names = frozenset(r.device for r in reports if r.end is DeviceEnd.PENDING and not r.started)
                self.store.note(self.rollout_id, "timeout", wave=index, not_started=sorted(names))
            self._not_started = (index, names)
        late = self._not_started[1]
        return [replace(r, late=True) if r.device in late else r for r in reports]

    def _record_timeouts(self, reports: list[DeviceReport], verdict: WaveVerdict) -> None:
        """Store the ends the verdict gave (a timeout's, an unknown device's skip)."""
        skipped = {r.device for r in reports if r.end is DeviceEnd.SKIPPED} | set(verdict.skipped)
        for device, end in [
            *((d, DeviceEnd.SKIPPED) for d in sorted(skipped)),
            *((d, DeviceEnd.TIMED_OUT) for d in verdict.timed_out),
        ]:
            if self._recorded.get(device) != end.value:
                self.store.record_job(self.rollout_id, device, end)
                self._recorded[device] = end.value

    def _trip(self, index: int, verdict: WaveVerdict) -> None:
        self.store.set_wave(
            self.rollout_id, index, WaveState.TRIPPED, figures=asdict(verdict.figures), reason=verdict.reason
        )
        self.store.set_state(self.rollout_id, RolloutState.ABORTED, verdict.reason)
        log.warning("fleet.rollout.aborted", rollout=self.rollout_id, wave=index, why=verdict.reason)
        self._close_wave()

    def _done_reason(self) -> str:
        """``every wave held``, and what runs when devices run another precision than asked."""
        build = self.request.build
        summary = precision_summary(
            self.store.devices(self.rollout_id), build.precision if build is not None else None
        )
        note = end_note(summary)
        return f"every wave held; {note}" if note else "every wave held"

    # -- rollback ------------------------------------------------------------------------------------

    def _wants_rollback(self) -> bool:
        """Asked once the rollout is ABORTED (the operator's abort is logged before the state moves)."""
        if self._wants is None:
            self._wants = self.request.rollback_on_abort or any(
                what == "abort" and detail.get("rollback")
                for what, detail in self.store.events(self.rollout_id)
            )
        return self._wants
