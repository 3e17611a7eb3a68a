"""A ``start`` request made a stored rollout: the uploaded model (and calibration) found and checked,
the plan and its manifest built, and each device's current model looked up (what a rollback returns
it to)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.fleet.base.untrusted import shown
from agent.fleet.controller.requests import ControllerError, ModelNotUploadedError
from agent.fleet.deploy.manifest import check_device_ids, plan_manifest
from agent.fleet.deploy.model_check import check_model_file
from agent.fleet.deploy.plan import new_job_id, next_sequence
from agent.fleet.rollout.records import RolloutPlan
from agent.fleet.rollout.spec import RolloutRequest, model_ref, plan_for, wheel_files
from agent.fleet.view.status import collect_fleet
from agent.mqtt.settings import MqttSettings
from agent.protocol.device_targets import MAX_OVERLAY_BYTES, target_kind


class UnknownDocumentError(ControllerError):
    """A ``document`` request for bytes the repository does not hold as an overlay."""

    code = "unknown_document"


def repository_document(model_path: Callable[[str], Path], sha256: str) -> dict[str, Any]:
    """The ``document`` verb: a configuration overlay the repository holds, as text, for ``fleet config
    get|diff`` (ControllerError ``unknown_document``: not held, too large for an overlay, or not text)."""
    if not re.fullmatch(r"[0-9a-f]{64}", sha256):
        raise UnknownDocumentError("document: sha256 must be 64 lowercase hex digits")
    path = model_path(sha256)
    if not path.is_file() or path.stat().st_size > MAX_OVERLAY_BYTES:
        raise UnknownDocumentError(f"document {sha256[:12]}: the repository holds no overlay of that hash")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UnknownDocumentError(f"document {sha256[:12]}: not text, so not an overlay") from exc
    return {"sha256": sha256, "text": text}


def check_target_document(request: RolloutRequest, document: Path, model_path: Callable[[str], Path]) -> None:
    """Raise ControllerError unless ``document`` is what ``request.slot`` takes (an overlay a device
    accepts, or an agent release whose every wheel the repository holds under the name it gives)."""
    from agent.errors import ConfigError
    from agent.fleet.deploy.overlay import parse_overlay
    from agent.protocol.device_targets import AgentRelease

    name = f"{request.slot} document {request.model_sha256[:12]}"
    try:
        if target_kind(request.slot) == "config":
            parse_overlay(document.read_bytes(), name)
            return
        release = AgentRelease.model_validate_json(document.read_bytes())
    except ConfigError as exc:
        raise ControllerError(f"{exc}: {'; '.join(exc.problems)}") from exc
    except ValueError as exc:  # pydantic's ValidationError
        raise ControllerError(f"{name} is not an agent release: {exc}") from exc
    named = {w.filename: w.sha256 for w in release.wheels}
    asked = {w.name: w.sha256 for w in request.wheels or ()}
    if named != asked:
        raise ControllerError(f"{name}: the wheels asked for are not the ones the release names")
    if request.version != release.version:
        raise ControllerError(f"{name}: version {request.version!r}, the release says {release.version!r}")
    for wheel in release.wheels:
        if not model_path(wheel.sha256).is_file():
            raise ControllerError(
                f"wheel {wheel.filename} ({wheel.sha256[:12]}) is not in the controller's repository: "
                "`fleet rollout start --agent-release DIR` uploads it"
            )


def stored_rollout(
    request: RolloutRequest, model_path: Callable[[str], Path], settings: MqttSettings, select_wait_s: float
) -> RolloutPlan:
    """The rollout ``request`` asks for, ready for the store (ModelNotUploadedError: the model is not
    in the repository; ControllerError: its calibration is not; ModelFileError: no device could load it).

    ``model_path`` names the repository's file of a SHA-256; the fleet's retained ``up/info`` is
    collected for at most ``select_wait_s`` seconds.
    """
    model = model_path(request.model_sha256)
    if not model.is_file():
        raise ModelNotUploadedError(
            f"model {request.model_sha256} is not in the controller's repository; upload it first"
        )
    kind = target_kind(request.slot)
    if kind == "model":
        # The repository takes any uploaded bytes: a file no device can load is refused here, before
        # its canaries pull it (ModelFileError, code bad_model).
        check_model_file(
            model,
            name=f"model {shown(request.model_name, 64)} ({request.model_sha256[:12]})",
            preprocess=request.preprocess,
            postprocess=request.postprocess,
        )
    else:
        check_target_document(request, model, model_path)
    model_id = request.model_id or Path(request.model_name).stem
    rollout_id = request.rollout_id or new_job_id(model_id, request.version)
    job_id = new_job_id(model_id, request.version)
    sequence = next_sequence()
    check_device_ids(request.devices)  # as FleetDeploy checks them, before anything is stored
    calib_cache = None
    if request.calib_sha256 is not None:
        calib_cache = model_path(request.calib_sha256)
        if not calib_cache.is_file():
            raise ControllerError(
                f"calibration {request.calib_sha256} is not in the controller's repository: "
                "`fleet rollout start --calib-cache FILE` uploads it"
            )
    plan = plan_for(
        request,
        model,
        tuple(request.devices),
        job_id=job_id,
        sequence=sequence,
        http_url=None,
        calib_cache=calib_cache,
        wheels=wheel_files(request, model_path),
    )
    manifest = plan_manifest(plan, job_id, sequence)
    fleet = {row.device: row for row in collect_fleet(settings, max_wait_s=select_wait_s)}
    from_models: dict[str, str | None] = {}
    if kind != "model":
        # What each device ran before, for people: a device puts back its own last good one.
        for device in request.devices:
            running = fleet[device].targets.get(kind) if device in fleet else None
            from_models[device] = (running or {}).get("version")
        return request.plan(rollout_id, job_id, sequence, from_models, manifest.model_dump(mode="json"))
    for device in request.devices:
        slot = fleet[device].slots.get(request.slot) if device in fleet else None
        sha = (slot or {}).get("sha256")
        from_models[device] = (
            model_ref(str(slot.get("model_id")), slot.get("version"), str(sha)) if slot and sha else None
        )
    return request.plan(rollout_id, job_id, sequence, from_models, manifest.model_dump(mode="json"))
