"""A deploy plan's manifest: the unsigned manifest a plan describes (the model hashed, its sources,
build and artifacts), and the check that every target id can be a topic level."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from pydantic import ValidationError

from agent.errors import ConfigError
from agent.fleet.deploy.plan import CALIBRATION_ARTIFACT, TARGET_MODEL_IDS, DeployPlan
from agent.protocol.manifest import DeployManifest, ModelSourceRef, build_manifest, describe_artifact
from agent.protocol.topics import check_level
from agent.specs.build import BuildSpec, CalibrationSource


def check_device_ids(devices: Iterable[str]) -> None:
    """ConfigError naming the first id that cannot be a topic level (it would address other devices)."""
    for device in devices:
        try:
            check_level(device, "device id")
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc


def plan_manifest(plan: DeployPlan, job_id: str, sequence: int) -> DeployManifest:
    """The unsigned manifest ``plan`` describes (ConfigError listing what does not validate).

    Hashes the model file; connects to nothing (the controller records a rollout's manifest with it).
    """
    sources = [ModelSourceRef(kind="mqtt")]
    if plan.http_url:
        sources.insert(0, ModelSourceRef(kind="http", url=plan.http_url))
    build = plan.build
    artifacts = []
    try:
        if plan.calib_cache is not None:
            artifacts.append(
                describe_artifact(
                    Path(plan.calib_cache),
                    name=CALIBRATION_ARTIFACT,
                    kind="calibration",
                    chunk_size=plan.chunk_size,
                    url=plan.calib_http_url,
                )
            )
            calibration = CalibrationSource(kind="cache", artifact=CALIBRATION_ARTIFACT)
            build = (build or BuildSpec(precision="int8")).model_copy(update={"calibration": calibration})
        artifacts.extend(
            describe_artifact(Path(path), name=name, kind="wheel", chunk_size=plan.chunk_size)
            for name, path in plan.wheels
        )
        return build_manifest(
            Path(plan.model),
            job_id=job_id,
            sequence=sequence,
            slot=plan.slot,
            model_id=plan.model_id or Path(plan.model).stem,
            version=plan.version,
            chunk_size=plan.chunk_size,
            sources=sources,
            build=build,
            artifacts=artifacts,
            preprocess=plan.preprocess,
            postprocess=plan.postprocess,
            shadow=plan.shadow,
            probation_s=plan.probation_s,
            probation=plan.probation,
            share_engines=plan.share_engines,
            rollback=plan.rollback,
        )
    except ValidationError as exc:
        problems = [
            f"{'.'.join(str(p) for p in e['loc']) or 'manifest'}: {e['msg']}"
            for e in exc.errors(include_url=False)
        ]
        raise ConfigError("cannot build the deploy manifest", problems) from exc


def target_manifest(
    target: str, document: Path, *, version: str, wheels: tuple[tuple[str, Path], ...] = ()
) -> DeployManifest:
    """The manifest of a device target's ``document`` (and an agent release's ``wheels``) as a release
    binds it: its bytes, its wheels, its kind, model id and version (ConfigError when it does not
    validate)."""
    plan = DeployPlan(
        model=document,
        devices=(),
        slot=target,
        version=version,
        model_id=TARGET_MODEL_IDS[target],
        wheels=wheels,
    )
    return plan_manifest(plan, "release", 1)
