"""The device's own targets (``_config``, ``_agent``) as the job runner sees them: what replaces the
model's verify, build and activate steps.

A job for a target runs the same way as a model's: QUEUED, DOWNLOADING (the document through the same
resumable pull, then its artifacts: the wheels the device lacks), VERIFYING (:meth:`DeviceTarget.verify`),
BUILDING (:meth:`DeviceTarget.install`: a release installed side by side, an overlay's secrets
written), then PROBATION through ``guard`` (:meth:`DeviceTarget.apply`: applied, watched) and ACTIVE,
or ROLLED_BACK when ``apply`` raises :class:`~agent.protocol.delivery_errors.RolledBackError`.

Applying may restart the agent (a configuration that cannot be applied live, a new agent release).
The job is then resumed after the restart like any interrupted job (the ledger says it did not end):
the runner calls every step again, so each step must notice on disk that it already ran for this
``manifest.job_id`` and go on from there (a finished install is skipped; ``apply`` returns once the
running agent was confirmed, raises once the device put the old one back).

The delivery service knows targets only through this protocol; the composition root registers them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Protocol

from agent.delivery.jobs.steps import GuardReporter, JobReporter
from agent.protocol.manifest import DeployManifest


class DeviceTarget(Protocol):
    """One of the device's own targets; registered under its name (``_config``, ``_agent``)."""

    def held(self) -> Collection[str]:
        """The SHA-256 of artifacts the target keeps itself: the job does not fetch them (``install``
        gets only the others)."""

    def verify(self, document: Path, manifest: DeployManifest) -> None:
        """Raise a :class:`~agent.errors.RejectedError` (``config_invalid``, ``agent_incompatible``)
        unless ``document`` (hash-checked already) can be applied on this device; changes nothing."""

    def install(
        self, document: Path, artifacts: Mapping[str, Path], manifest: DeployManifest, reporter: JobReporter
    ) -> None:
        """Prepare everything beside what runs (a release's environment, an overlay's secrets), touching
        nothing the running agent uses; ``artifacts`` by name (a wheel's file name). Raise a
        :class:`~agent.errors.DeliveryError` (``agent_install_failed``) on failure."""

    def apply(self, document: Path, manifest: DeployManifest, guard: GuardReporter) -> None:
        """Put the new version in place and watch it (``guard.enter(JobState.PROBATION)``); return once
        it is confirmed, raise :class:`~agent.protocol.delivery_errors.RolledBackError` once the old
        one is back. May restart the agent (the job resumes after the restart)."""


#: The targets a device serves, by name.
DeviceTargets = Mapping[str, DeviceTarget]
