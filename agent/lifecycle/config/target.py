"""The ``_config`` target: a configuration overlay verified, installed, applied and watched by the job runner.

verify: the overlay's keys (:mod:`.document`), its sealed values opened, and agent.yaml with it
validated exactly as ``edge-agent check-config`` does (``config_invalid`` naming the key; nothing
changes). install: the secrets written (0600) and the overlay stored beside the running one. apply:
the record names the new overlay (one atomic write), then a reload applies it when every changed key
is live (:func:`agent.config.changes.needs_restart`), else the agent exits with
:data:`~agent.lifecycle.restart.RESTART_EXIT_CODE` for systemd to start it again with the overlay.
Then the probation window (``manifest.probation_s``, :data:`DEFAULT_PROBATION_S` by default): the
device is judged by :func:`agent.lifecycle.health.unhealthy_because` against a reading taken before
the change; unhealthy, the last good overlay is put back the same way (reload or restart) and the
job ends ``ROLLED_BACK config_reverted`` with the reason. Every step notices on disk that it ran for
the job, so a job resumed after a restart (its own, or a kill) goes on from where it was.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path

import structlog

from agent.config import AgentConfig, load_config
from agent.delivery.jobs.steps import GuardReporter, JobReporter
from agent.errors import ConfigError
from agent.lifecycle.config.document import OpenFn, opened, read_overlay, with_secret_files
from agent.lifecycle.config.record import ConfigRecord, OverlayFiles, OverlayRef, PendingChange, Reading
from agent.lifecycle.config.startup import bounded, put_back
from agent.lifecycle.health import HealthReading, unhealthy_because
from agent.lifecycle.running import RunningAgent
from agent.protocol.delivery_errors import ConfigInvalidError, JobCancelledError, RolledBackError
from agent.protocol.device_targets import TargetInfo
from agent.protocol.manifest import DeployManifest
from agent.protocol.messages import JobState

log = structlog.get_logger(__name__)

#: The probation window when the manifest sets none, seconds.
DEFAULT_PROBATION_S = 60.0
#: Longest overlay version (``up/info``'s ``config.version`` carries it).
MAX_VERSION = 64
#: Between the two readings that tell which streams flow before a change, seconds.
BEFORE_SAMPLE_S = 2.0


class ConfigTarget:
    """The ``_config`` target (a :class:`~agent.delivery.jobs.targets.DeviceTarget`)."""

    def __init__(
        self,
        config_path: Path,
        state_dir: Path,
        open_value: OpenFn,
        agent: RunningAgent,
        *,
        before_sample_s: float = BEFORE_SAMPLE_S,
    ) -> None:
        self.config_path = config_path
        self.files = OverlayFiles(state_dir)
        self._open = open_value
        self._agent = agent
        self._before_sample_s = before_sample_s

    def info(self) -> TargetInfo:
        """``up/info``'s ``config``: the overlay that runs, the one being tried, the last put back."""
        record = self.files.read()
        return TargetInfo(
            version=record.active.version if record.active else None,
            job_id=record.active.job_id if record.active else None,
            pending=record.pending.overlay.version if record.pending else None,
            reverted=record.reverted.reason if record.reverted else None,
        )

    # -- the job's steps --------------------------------------------------------------------------

    def held(self) -> frozenset[str]:
        """An overlay has no artifacts."""
        return frozenset()

    def verify(self, document: Path, manifest: DeployManifest) -> None:
        if len(manifest.version) > MAX_VERSION:
            raise ConfigInvalidError(
                f"version: an overlay's version has at most {MAX_VERSION} characters (up/info reports it)",
                job_id=manifest.job_id,
            )
        if self._applied(manifest.job_id):
            return  # resumed after it was applied: checked then, and what runs now is its business
        overlay = read_overlay(document, manifest.job_id)
        opened(overlay, self._open, manifest.job_id)  # opened to be sure they open; not kept
        files = {path: self.files.secret_path(manifest.sha256, path) for path in overlay.sealed}
        self._checked(with_secret_files(overlay, files), manifest.job_id)

    def install(
        self, document: Path, artifacts: Mapping[str, Path], manifest: DeployManifest, reporter: JobReporter
    ) -> None:
        if self.files.has_overlay(manifest.sha256):
            reporter.progress(1.0)
            return  # installed before a restart: the same document, the same secrets
        overlay = read_overlay(document, manifest.job_id)
        values = opened(overlay, self._open, manifest.job_id)
        written = {path: self.files.write_secret(manifest.sha256, path, v) for path, v in values.items()}
        self.files.write_overlay(manifest.sha256, with_secret_files(overlay, written))
        reporter.progress(1.0)

    def apply(self, document: Path, manifest: DeployManifest, guard: GuardReporter) -> None:
        record = self.files.read()
        job_id = manifest.job_id
        if record.reverted is not None and record.reverted.job_id == job_id:
            raise RolledBackError(record.reverted.reason, code="config_reverted")
        pending = record.pending
        if pending is not None and pending.overlay.job_id == job_id:
            log.info("config.overlay.resumed", job=job_id, version=manifest.version)
            guard.enter(JobState.PROBATION)
        elif record.active is not None and record.active.job_id == job_id:
            guard.enter(JobState.PROBATION)  # confirmed before a restart: the job passes through it
            return
        else:
            pending = self._put_in_place(record, manifest, guard)
        self._watch(pending, manifest, guard)

    # -- applying, watching, putting back ---------------------------------------------------------

    def _applied(self, job_id: str) -> bool:
        """The record names ``job_id``: it was put in place (and may be confirmed or put back)."""
        record = self.files.read()
        refs = (record.active, record.pending.overlay if record.pending else None, record.reverted)
        return any(ref is not None and ref.job_id == job_id for ref in refs)

    def _put_in_place(
        self, record: ConfigRecord, manifest: DeployManifest, guard: GuardReporter
    ) -> PendingChange:
        ref = OverlayRef(version=manifest.version, job_id=manifest.job_id, sha256=manifest.sha256)
        new = self._checked(self.files.load_overlay(ref), manifest.job_id)
        later = self._agent.restart_keys(new)
        before = self._before(guard.cancel)
        pending = PendingChange(overlay=ref, restart=bool(later), before=Reading.of(before))
        self.files.write(record.model_copy(update={"active": ref, "pending": pending, "reverted": None}))
        guard.enter(JobState.PROBATION)
        self._agent.changed()
        if later:
            log.info("config.overlay.restart", job=manifest.job_id, version=manifest.version, keys=later)
            self._restart(guard.cancel)
        log.info("config.overlay.applied", job=manifest.job_id, version=manifest.version, how="reload")
        self._agent.reload()
        return pending

    def _watch(self, pending: PendingChange, manifest: DeployManifest, guard: GuardReporter) -> None:
        window = manifest.probation_s if manifest.probation_s is not None else DEFAULT_PROBATION_S
        self._wait_started(guard.cancel)
        self._agent.health()  # frames are counted from here
        _wait(guard.cancel, window)
        why = unhealthy_because(pending.before.health(), self._agent.health())
        record = self.files.read()
        if why is None:
            record = record.model_copy(update={"last_good": record.active, "pending": None})
            self.files.write(record)
            self.files.collect(record)
            self._agent.changed()
            log.info("config.overlay.confirmed", job=manifest.job_id, version=manifest.version)
            return
        back = record.last_good.version if record.last_good is not None else "no overlay"
        reason = f"{why} within {window:g} s of applying {manifest.version}; put back {back}"
        record = put_back(record, reason)
        self.files.write(record)
        self._agent.changed()
        log.warning("config.overlay.reverted", job=manifest.job_id, version=manifest.version, reason=reason)
        if pending.restart:
            self._restart(guard.cancel)
        self._agent.reload()
        raise RolledBackError(bounded(reason), code="config_reverted")

    def _restart(self, cancel: threading.Event) -> None:
        """Ask for the restart and wait for the stop that it is (the job resumes after it)."""
        self._agent.restart()
        cancel.wait()
        raise JobCancelledError("the agent restarts to apply its configuration")

    def _wait_started(self, cancel: threading.Event) -> None:
        # A job may run while the agent still starts (resumed, or arrived on the first connect):
        # readings mean something once its streams and slots run.
        while not self._agent.started.wait(0.5):
            if cancel.is_set():
                raise JobCancelledError("the agent stopped before it started")

    def _before(self, cancel: threading.Event) -> HealthReading:
        self._wait_started(cancel)
        self._agent.health()
        _wait(cancel, self._before_sample_s)
        return self._agent.health()

    def _checked(self, overlay: dict[str, object], job_id: str) -> AgentConfig:
        """agent.yaml with ``overlay``, validated as ``check-config`` does; ConfigInvalidError if not."""
        try:
            return load_config(self.config_path, overlay=overlay)
        except ConfigError as exc:
            problems = "; ".join(exc.problems) or str(exc)
            raise ConfigInvalidError(
                bounded(f"the configuration with this overlay is invalid: {problems}"), job_id=job_id
            ) from exc


def _wait(cancel: threading.Event, seconds: float) -> None:
    if cancel.wait(seconds):
        raise JobCancelledError("the job was cancelled while its configuration was watched")
