"""The ``_agent`` target: what the job runner calls for an agent release (verify, install, apply).

The composition root builds one :class:`AgentReleaseTarget` with the agent's state directory and its
health reading, calls :meth:`~AgentReleaseTarget.start` at start-up (a release on trial starts being
watched before the job resumes) and reports :meth:`~AgentReleaseTarget.info` as ``up/info``'s
``agent_release``. docs/agent-updates.md tells the operator's side of it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from pydantic import ValidationError

from agent.delivery.jobs.steps import GuardReporter, JobReporter
from agent.lifecycle.health import HealthReading
from agent.lifecycle.release.confirmation import Confirmation, reading_record
from agent.lifecycle.release.install import install_release
from agent.lifecycle.release.layout import (
    COMPLETE,
    CURRENT,
    GOOD,
    WHEELS,
    PendingUpdate,
    Releases,
    running_release,
    stop_point,
)
from agent.lifecycle.release.wheels import WheelCache, incompatible_because
from agent.lifecycle.restart import RESTART_EXIT_CODE
from agent.protocol.delivery_errors import (
    AgentIncompatibleError,
    AgentInstallFailedError,
    JobCancelledError,
    RolledBackError,
)
from agent.protocol.device_targets import MAX_AGENT_RELEASE_BYTES, AgentRelease, TargetInfo
from agent.protocol.manifest import DeployManifest
from agent.protocol.messages import JobState

#: Healthy without a break this long confirms a release: longer than a crash that waits 30 s.
DEFAULT_CONFIRM_S = 60.0
#: The deadline for the confirmation when the manifest sets no ``probation_s``.
DEFAULT_DEADLINE_S = 120.0
#: Starts a release on trial gets (each crash costs one) before the previous one is put back.
DEFAULT_MAX_ATTEMPTS = 3
#: The longest an install (venv and pip) may take.
DEFAULT_INSTALL_TIMEOUT_S = 900.0


def exit_for_restart() -> None:
    """Leave at once with :data:`RESTART_EXIT_CODE`: systemd starts the launcher again, which starts
    the release ``current`` names. The root may pass an ordered stop that exits with the same code."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(RESTART_EXIT_CODE)


class AgentReleaseTarget:
    """Agent releases side by side under ``{state_dir}/releases``, one on trial at a time."""

    def __init__(
        self,
        state_dir: Path,
        health: Callable[[], HealthReading],
        *,
        restart: Callable[[], None] = exit_for_restart,
        confirm_s: float = DEFAULT_CONFIRM_S,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        install_timeout_s: float = DEFAULT_INSTALL_TIMEOUT_S,
        poll_s: float = 1.0,
    ) -> None:
        self.releases = Releases(Path(state_dir) / "releases")
        self.cache = WheelCache(self.releases.root)
        self._health = health
        self._restart = restart
        self._confirm_s = confirm_s
        self._max_attempts = max_attempts
        self._install_timeout_s = install_timeout_s
        self._poll_s = poll_s
        self.running = running_release()
        self._confirmation = Confirmation(self.releases, self.running, health, restart, poll_s=poll_s)

    def start(self) -> bool:
        """At start-up: watch this release if it is on trial (True), so it is confirmed or put back."""
        return self._confirmation.start()

    def stop(self) -> None:
        self._confirmation.stop()

    def held(self) -> frozenset[str]:
        """The SHA-256 of every wheel held: the job need not fetch those artifacts (install takes them
        from the cache when they are not among the delivered files)."""
        return self.cache.held()

    def info(self) -> TargetInfo:
        """``up/info``'s ``agent_release``: what runs, the job that put it there, what is on trial, what
        was put back."""
        update = self.releases.read_update()
        outcome = self.releases.read_outcome()
        running = self.running or self.releases.link(CURRENT)
        job_id = None
        if outcome is not None and outcome.outcome == "active" and outcome.version == running:
            job_id = outcome.job_id
        elif update is not None and update.candidate == running:
            job_id = update.job_id
        reverted = None
        if outcome is not None and outcome.outcome == "rolled_back":
            reverted = f"{outcome.version}: {outcome.reason}"[:300]
        return TargetInfo(
            version=running, job_id=job_id, pending=update.candidate if update else None, reverted=reverted
        )

    # --- the DeviceTarget steps -------------------------------------------------------------

    def verify(self, document: Path, manifest: DeployManifest) -> None:
        release = _read_release(document)
        if release.version != manifest.version:
            raise AgentIncompatibleError(
                f"the manifest's version {manifest.version} is not the release's {release.version}"
            )
        if self.running is None:
            raise AgentIncompatibleError(
                "this agent was not started by the release launcher: install it as a release first "
                "(docs/operations.md, 'Install as a service')"
            )
        reason = incompatible_because(release)
        if reason is not None:
            raise AgentIncompatibleError(reason)
        if _deadline_s(manifest) <= self._confirm_s:
            raise AgentIncompatibleError(
                f"probation_s {_deadline_s(manifest):g} leaves no time: this device confirms a release "
                f"after {self._confirm_s:g} s of health"
            )

    def install(
        self, document: Path, artifacts: Mapping[str, Path], manifest: DeployManifest, reporter: JobReporter
    ) -> None:
        release = _read_release(document)
        if release.version == self.running:
            return
        update = self.releases.read_update()
        if update is not None and update.job_id != manifest.job_id:
            raise AgentInstallFailedError(
                f"release {update.candidate} (job {update.job_id}) is still on trial: send this one again "
                "once that job ended"
            )
        try:
            install_release(
                self.releases,
                self.cache,
                release,
                artifacts,
                job_id=manifest.job_id,
                timeout_s=self._install_timeout_s,
                cancel=reporter.cancel,
            )
        except OSError as exc:
            raise AgentInstallFailedError(f"installing release {release.version}: {exc}") from exc
        reporter.progress(1.0)

    def apply(self, document: Path, manifest: DeployManifest, guard: GuardReporter) -> None:
        release = _read_release(document)
        outcome = self.releases.read_outcome()
        if outcome is not None and outcome.job_id == manifest.job_id:
            if outcome.outcome == "active":
                self.keep_only_what_is_used()
                return
            raise RolledBackError(
                f"release {outcome.version} was put back: {outcome.reason}", code="agent_reverted"
            )
        update = self.releases.read_update()
        if update is not None and update.job_id == manifest.job_id:
            guard.enter(JobState.PROBATION)
            if self.running == update.candidate:
                self._await_confirmation(manifest, guard)
                return
            # Recorded and maybe switched, but this process was not restarted yet.
            self.releases.switch(CURRENT, update.candidate)
            self._restart_and_wait(guard)
        if release.version == self.running:
            return
        if not self.releases.is_complete(release.version) or self.running is None:
            raise AgentInstallFailedError(f"release {release.version} is not installed")
        deadline_s = _deadline_s(manifest)
        update = PendingUpdate(
            job_id=manifest.job_id,
            previous=self.running,
            candidate=release.version,
            deadline=time.time() + deadline_s,
            deadline_s=deadline_s,
            confirm_s=self._confirm_s,
            max_attempts=self._max_attempts,
            before=reading_record(self._health()),
        )
        self.releases.write_update(update)
        stop_point("update-recorded")
        guard.enter(JobState.PROBATION)
        self.releases.switch(CURRENT, release.version)
        stop_point("current-switched")
        self._restart_and_wait(guard)

    def _await_confirmation(self, manifest: DeployManifest, guard: GuardReporter) -> None:
        self.start()
        while not self._confirmation.ended.wait(self._poll_s):
            if guard.cancel.is_set():
                raise JobCancelledError("the agent is stopping; the release stays on trial")
        outcome = self.releases.read_outcome()
        if outcome is None or outcome.job_id != manifest.job_id or outcome.outcome != "active":
            # Put back by the watch, which restarts the agent: the previous release ends the job.
            self._wait_for_stop(guard)
        self.keep_only_what_is_used()

    def _restart_and_wait(self, guard: GuardReporter) -> None:
        self._restart()
        self._wait_for_stop(guard)

    def _wait_for_stop(self, guard: GuardReporter) -> None:
        """Until the agent stops (a restart the root runs in order): the job is interrupted, not ended,
        and resumes in the release that starts next."""
        while not guard.cancel.wait(self._poll_s):
            pass
        raise JobCancelledError("the agent restarts into another release; the job resumes there")

    def keep_only_what_is_used(self) -> None:
        """Remove releases and wheels no link or record names (after a confirmation, with none on trial)."""
        if self.releases.read_update() is not None:
            return
        outcome = self.releases.read_outcome()
        keep = {self.releases.link(CURRENT), self.releases.link(GOOD), self.running}
        if outcome is not None:
            keep |= {outcome.version, outcome.previous}
        wheels: set[str] = set()
        for entry in self.releases.root.iterdir():
            if entry.name.startswith(".staging-"):  # an install a kill interrupted and no job resumed
                shutil.rmtree(entry, ignore_errors=True)
            if entry.name.startswith(".") or entry.name == WHEELS or entry.is_symlink() or not entry.is_dir():
                continue
            if entry.name not in keep:
                shutil.rmtree(entry, ignore_errors=True)
                continue
            with contextlib.suppress(OSError, ValueError):
                wheels.update(json.loads((entry / COMPLETE).read_text(encoding="utf-8")).get("wheels", []))
        self.cache.keep_only(wheels)


def _deadline_s(manifest: DeployManifest) -> float:
    return manifest.probation_s or DEFAULT_DEADLINE_S


def _read_release(document: Path) -> AgentRelease:
    data = document.read_bytes()
    if len(data) > MAX_AGENT_RELEASE_BYTES:
        raise AgentIncompatibleError(
            f"the release document is {len(data)} bytes, over {MAX_AGENT_RELEASE_BYTES}"
        )
    try:
        return AgentRelease.model_validate_json(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or '(document)'}: {e['msg']}" for e in exc.errors()
        )
        raise AgentIncompatibleError(f"not an agent release this agent reads: {problems}") from exc
