"""What a rollout is asked to do: :class:`RolloutRequest`, as ``fleet rollout start`` sends it to the
controller and as ``fleet deploy`` builds it for its one-wave rollout, and the plan the store keeps.

The request names the model by its SHA-256 (the controller keeps the bytes in its model repo, the
CLI uploads them when the repo lacks them) and carries the manifest fields ``fleet deploy`` takes.
Everything a restarted controller needs to publish the *same* desired state again (job id, manifest
sequence, every device's previous model) is fixed when the rollout is created and stored with it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from agent.fleet.deploy.plan import DeployPlan
from agent.fleet.rollout.gate import GatePolicy
from agent.fleet.rollout.records import RolloutPlan
from agent.fleet.rollout.waves import parse_max_failed, parse_waves, split_waves
from agent.model_base import StrictModel
from agent.protocol.device_targets import MAX_RELEASE_WHEELS, WHEEL_FILENAME, target_kind
from agent.protocol.manifest import DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE
from agent.protocol.proving import ProbationSpec, ShadowSpec
from agent.specs.build import BuildSpec
from agent.specs.postprocess import PostprocessSpec
from agent.specs.preprocess import PreprocessSpec
from agent.trust.release import MAX_RELEASE_BYTES

#: A rollout id: what ``fleet rollout status ID`` takes; it also names the rollback job.
ROLLOUT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,79}$")
#: Default wave timeout: long enough for a large model over a slow site link plus shadow and probation.
DEFAULT_WAVE_TIMEOUT_S = 1800.0


class WheelRef(StrictModel):
    """One wheel of an agent release rolled out: its file name and the repository's copy (by hash)."""

    name: str = Field(pattern=WHEEL_FILENAME.pattern, max_length=200)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class RolloutRequest(StrictModel):
    """A rollout as asked for: the model (by hash), where, in which waves, with which gate.

    ``slot`` may name one of the device's own targets (``_config``, ``_agent``): the "model" is then
    the target's document (the overlay YAML, the agent release JSON), by hash like a model, and an
    agent release's wheels are :attr:`wheels`, each a manifest artifact of kind ``wheel``.
    """

    rollout_id: str | None = Field(None, pattern=ROLLOUT_ID.pattern)
    model_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    model_name: str = Field(description="The model file's name (its stem is the default model id).")
    slot: str
    version: str
    model_id: str | None = None
    devices: list[str] = Field(min_length=1)
    waves: str = "100%"
    soak_s: float = Field(0.0, ge=0.0)
    max_failed: str = "0"
    wave_timeout_s: float = Field(DEFAULT_WAVE_TIMEOUT_S, gt=0.0)
    on_timeout: Literal["skip", "wait"] = "skip"
    rollback_on_abort: bool = False
    supersedes: str | None = None
    chunk_size: int = Field(DEFAULT_CHUNK_SIZE, ge=MIN_CHUNK_SIZE, le=MAX_CHUNK_SIZE)
    build: BuildSpec | None = None
    preprocess: PreprocessSpec | None = None
    postprocess: PostprocessSpec | None = None
    shadow: ShadowSpec | None = None
    probation_s: float | None = Field(None, gt=0.0, le=86_400.0)
    probation: ProbationSpec | None = None
    #: The operator's INT8 calibration (a table or TensorRT cache), shipped as a signed manifest
    #: artifact: every device quantizes with it instead of calibrating on its own frames.
    calib_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    #: Devices share engines through the controller (docs/engines.md); None: the controller's
    #: ``engines.share`` setting decides (it resolves it when the rollout starts).
    share_engines: bool | None = None
    #: Whether the gate counts a device that runs another precision than ``build.precision`` asked
    #: (an INT8 engine its accuracy guard refused) as unhealthy: ``allow`` only reports it.
    precision_fallback: Literal["allow", "fail"] = "allow"
    #: The rollout whose devices this one takes back to the model each served before it
    #: (``fleet rollout rollback``): its manifests are ways back, with no shadow and no probation.
    rollback_of: str | None = Field(None, pattern=ROLLOUT_ID.pattern)
    #: The model's signed release (`fleet trust release`, docs/trust.md), sent beside every device's
    #: manifest for devices with a fleet root; None for a fleet without one. A way back to this model
    #: (an abort's rollback, ``fleet rollout rollback``) carries it again.
    release: str | None = Field(None, max_length=MAX_RELEASE_BYTES)
    #: An agent release's wheels (``slot`` ``_agent``), in the release document's order.
    wheels: list[WheelRef] | None = Field(None, max_length=MAX_RELEASE_WHEELS)

    @model_validator(mode="after")
    def _target_is_a_document(self) -> RolloutRequest:
        kind = target_kind(self.slot)
        if kind == "model":
            if self.wheels is not None:
                raise ValueError("wheels belong to an agent release (target _agent), not to a model slot")
            return self
        model_only = {
            "build": self.build,
            "preprocess": self.preprocess,
            "postprocess": self.postprocess,
            "shadow": self.shadow,
            "calib_sha256": self.calib_sha256,
            "share_engines": self.share_engines,
            "rollback_of": self.rollback_of,
        }
        given = sorted(name for name, value in model_only.items() if value is not None)
        if given:
            raise ValueError(f"a rollout of {self.slot} carries no model: leave out {', '.join(given)}")
        if self.rollback_on_abort:
            raise ValueError(
                f"a rollout of {self.slot} cannot move devices back: each device puts back its own last "
                "good one when the new one is not healthy; roll out the previous one to go back"
            )
        if (kind == "agent") != bool(self.wheels):
            raise ValueError("an agent release (target _agent) names its wheels; a configuration has none")
        return self

    @model_validator(mode="after")
    def _way_back_unguarded(self) -> RolloutRequest:
        if self.rollback_of is not None and (self.shadow is not None or self.probation_s is not None):
            raise ValueError(
                f"a rollback of rollout {self.rollback_of} has no shadow and no probation: either would "
                "judge the way back against, or swap back to, the model being rolled back from"
            )
        return self

    @model_validator(mode="after")
    def _calibration_needs_int8(self) -> RolloutRequest:
        if self.calib_sha256 is not None and (
            self.build is None or self.build.precision not in ("int8", "best")
        ):
            raise ValueError("a calibration cache (--calib-cache) needs an INT8 build: add --precision int8")
        return self

    def policy(self) -> GatePolicy:
        """The gate this rollout asks for (UsageError on a bad ``max_failed``)."""
        return GatePolicy(
            max_failed=parse_max_failed(self.max_failed),
            on_timeout=self.on_timeout,
            needs_shadow=self.shadow is not None,
            min_agreement=None if self.shadow is None else self.shadow.min_agreement,
            needs_probation=self.probation_s is not None,
            precision_fallback=self.precision_fallback,
        )

    def plan(
        self,
        rollout_id: str,
        job_id: str,
        sequence: int,
        from_models: Mapping[str, str | None],
        manifest: Mapping[str, Any],
    ) -> RolloutPlan:
        """The store's plan: waves split from the device order, the spec a restart needs.

        Raises UsageError when ``waves`` or ``max_failed`` do not parse or the waves miss devices.
        """
        self.policy()  # a bad --max-failed is refused before anything is stored
        waves = split_waves(self.devices, parse_waves(self.waves))
        spec = {
            "request": self.model_dump(mode="json"),
            "sequence": sequence,
            "manifest": dict(manifest),
        }
        return RolloutPlan(
            rollout_id=rollout_id,
            slot=self.slot,
            job_id=job_id,
            to_version=self.version,
            waves=waves,
            from_versions=dict(from_models),
            spec=spec,
            supersedes=self.supersedes,
        )


def wheel_files(request: RolloutRequest, model_path: Callable[[str], Path]) -> tuple[tuple[str, Path], ...]:
    """An agent release's wheels as (file name, the repository's file), from ``model_path(sha256)``."""
    return tuple((w.name, model_path(w.sha256)) for w in request.wheels or ())


def request_of(spec: Mapping[str, Any]) -> RolloutRequest:
    """The request a stored rollout was created from (its ``spec``)."""
    return RolloutRequest.model_validate(spec["request"])


def model_ref(model_id: str, version: str | None, sha256: str) -> str:
    """How a device's previous model is kept in the store's ``from_version``: ``id:version@sha256``."""
    return f"{model_id}:{version or '-'}@{sha256}"


def ref_sha256(ref: str | None) -> str | None:
    """The SHA-256 in a :func:`model_ref` (None for a device that had no model in the slot)."""
    if not ref or "@" not in ref:
        return None
    return ref.rpartition("@")[2] or None


def plan_for(
    request: RolloutRequest,
    model: Path,
    devices: tuple[str, ...],
    *,
    job_id: str,
    sequence: int,
    http_url: str | None,
    calib_cache: Path | None = None,
    calib_http_url: str | None = None,
    wheels: tuple[tuple[str, Path], ...] = (),
) -> DeployPlan:
    """The FleetDeploy plan that publishes ``request``'s desired state to ``devices`` (``wheels``:
    an agent release's, by file name, from the repository)."""
    plan = DeployPlan(
        model=model,
        devices=devices,
        slot=request.slot,
        version=request.version,
        model_id=request.model_id or Path(request.model_name).stem,
        chunk_size=request.chunk_size,
        build=request.build,
        preprocess=request.preprocess,
        postprocess=request.postprocess,
        http_url=http_url,
        job_id=job_id,
        sequence=sequence,
        shadow=request.shadow,
        probation_s=request.probation_s,
        probation=request.probation,
        calib_cache=calib_cache,
        calib_http_url=calib_http_url,
        share_engines=request.share_engines,
        wheels=wheels,
    )
    return way_back(plan) if request.rollback_of is not None else plan


def way_back(plan: DeployPlan) -> DeployPlan:
    """``plan`` as a way back to a model its devices served before: the manifest says ``rollback``
    (the device records the model it leaves as rolled back from, never a rollback target), without
    shadow or probation, which would judge the way back against that model or swap back to it."""
    return dataclasses.replace(plan, rollback=True, shadow=None, probation_s=None, probation=None)
