"""The gate of ``down/desired/{slot}``: a payload checked into a manifest, or refused and reported once.

:class:`DesiredIntake` runs on the MQTT dispatcher thread. It parses and checks a payload
(:func:`~agent.protocol.manifest.parse_signed`: JSON, signature, shape, names, device), checks the
slot (the topic's, and one this device has or one of its own targets it serves), and hands the
manifest to the delivery service. A refusal is logged, and published as a REJECTED job status once
per job id: a job id that runs, ran or was refused already gets no second terminal state. A refused
payload is remembered per slot, so a retained bad manifest is reported once, not on every reconnect.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Collection, Mapping
from datetime import datetime, timezone

import structlog

from agent.delivery.jobs.records import JobRecords
from agent.delivery.jobs.steps import SlotSpecsFn
from agent.delivery.settings import DeliveryConfig
from agent.errors import DeliveryError
from agent.mqtt.inbound import InboundMessage
from agent.protocol.delivery_errors import TooLargeError, WrongSlotError
from agent.protocol.device_targets import (
    AGENT_TARGET,
    CONFIG_TARGET,
    DEVICE_TARGETS,
    MAX_AGENT_RELEASE_BYTES,
    MAX_OVERLAY_BYTES,
)
from agent.protocol.manifest import DeployManifest, parse_signed, recover_job_id
from agent.protocol.messages import JobState, JobStatus
from agent.signing import Ed25519PublicKey
from agent.trust.anchor import FleetRoot
from agent.trust.deployment import checked_release
from agent.trust.serving import ServingReleases

log = structlog.get_logger(__name__)

#: Largest document of each of the device's own targets: refused before anything is downloaded.
_TARGET_BYTES = {CONFIG_TARGET: MAX_OVERLAY_BYTES, AGENT_TARGET: MAX_AGENT_RELEASE_BYTES}
#: Refused payloads remembered per slot, so a retained bad manifest is reported once, not per reconnect.
_REJECTED_MEMORY = 32


class DesiredIntake:
    """Checks ``down/desired/{slot}`` payloads and hands each accepted manifest to ``accept``.

    ``accept(manifest, slot, digest)`` decides and queues the job (it may raise a
    :class:`DeliveryError`, which is refused like a bad payload); ``known(job_id)`` says whether a job
    id has states already; ``publish`` sends a REJECTED status.
    """

    def __init__(
        self,
        config: DeliveryConfig,
        *,
        device_id: str,
        trusted: Mapping[str, Ed25519PublicKey],
        slot_specs: SlotSpecsFn,
        records: JobRecords,
        accept: Callable[[DeployManifest, str, str], None],
        known: Callable[[str], bool],
        publish: Callable[[JobStatus], None],
        releases: ServingReleases,
        fleet_root: FleetRoot | None = None,
        targets: Collection[str] = frozenset(),
    ) -> None:
        """``targets``: the device's own targets (``_config``, ``_agent``) this device serves."""
        self.config = config
        self._targets = frozenset(targets)
        #: With a fleet root, desired states are checked against it and ``trusted`` is not used.
        self.fleet_root = fleet_root
        #: The release keys of each model taken under the root (a revoked one flags it in up/info).
        self.releases = releases
        self.device_id = device_id
        self.trusted = trusted
        self._slot_specs = slot_specs
        self._records = records
        self._accept = accept
        self._known = known
        self._publish = publish
        self._rejected: dict[str, deque[str]] = {}

    def handle(self, message: InboundMessage) -> None:
        """Handle one ``down/desired/{slot}`` message (on the dispatcher thread: decide, hand over)."""
        topic_slot = message.topic.rsplit("/", 1)[-1]
        if not message.payload:
            log.info("delivery.desired.cleared", slot=topic_slot)
            return
        digest = hashlib.sha256(message.payload).hexdigest()
        if digest in self._rejected.get(topic_slot, ()):
            return  # the same refused payload again (retained, re-delivered on reconnect)
        try:
            if self.fleet_root is not None:
                now = datetime.now(timezone.utc)
                manifest, release = checked_release(
                    self.fleet_root.current(), message.payload, self.device_id, now
                )
                self.releases.note(manifest.sha256, release)
            else:
                manifest = parse_signed(
                    message.payload, self.trusted, self.config.require_signature, self.device_id
                )
            self._check_slot(manifest, topic_slot)
            self._accept(manifest, topic_slot, digest)
        except DeliveryError as exc:
            self.refuse(exc, message.payload, topic_slot, digest)

    def forget_refusals(self) -> None:
        """Forget the refused payloads: a new fleet root may accept what the old one refused."""
        self._rejected.clear()

    def _check_slot(self, manifest: DeployManifest, topic_slot: str) -> None:
        if manifest.slot != topic_slot:
            raise WrongSlotError(
                f"manifest is for slot {manifest.slot!r} but arrived on the desired topic of slot "
                f"{topic_slot!r}; publish it on down/desired/{manifest.slot}",
                job_id=manifest.job_id,
            )
        if manifest.slot in DEVICE_TARGETS:
            if manifest.slot not in self._targets:
                raise WrongSlotError(
                    f"this device does not serve the target {manifest.slot!r} (an agent without it)",
                    job_id=manifest.job_id,
                )
            limit = _TARGET_BYTES[manifest.slot]
            if manifest.size > limit:
                raise TooLargeError(
                    f"a {manifest.slot} document has at most {limit} bytes, not {manifest.size}",
                    job_id=manifest.job_id,
                )
            return
        if self._slot_specs(manifest.slot) is None:
            raise WrongSlotError(
                f"this device has no slot {manifest.slot!r}; configure it under slots: first",
                job_id=manifest.job_id,
            )

    def refuse(self, exc: DeliveryError, payload: bytes, slot: str, digest: str) -> None:
        """Log the refusal of ``payload`` (digest ``digest``) on ``slot``; REJECTED once per job id."""
        job_id = getattr(exc, "job_id", None) or recover_job_id(payload)
        # One terminal state per job id: a job id that runs, ran or was refused already gets no REJECTED
        # (the same manifest on several slots' topics, an old one re-published, one refused before a
        # restart); the refusal is logged either way.
        report = job_id is not None and not self._known(job_id)
        log.error(
            "delivery.manifest.rejected",
            slot=slot,
            job=job_id,
            code=exc.code,
            error=str(exc),
            published=report,
        )
        memory = self._rejected.setdefault(slot, deque(maxlen=_REJECTED_MEMORY))
        memory.append(digest)
        if job_id is None or not report:
            return
        self._records.remember_refused(job_id)
        self._publish(
            JobStatus(job_id=job_id, slot=slot, state=JobState.REJECTED, error_code=exc.code, error=str(exc))
        )
