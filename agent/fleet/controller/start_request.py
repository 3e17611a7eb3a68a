"""A ``start`` request made a stored rollout: the uploaded model (and calibration) found and checked,
the plan and its manifest built, and each device's current model looked up (what a rollback returns
it to)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from agent.fleet.base.untrusted import shown
from agent.fleet.controller.requests import ControllerError, ModelNotUploadedError
from agent.fleet.deploy.manifest import check_device_ids, plan_manifest
from agent.fleet.deploy.model_check import check_model_file
from agent.fleet.deploy.plan import new_job_id, next_sequence
from agent.fleet.rollout.records import RolloutPlan
from agent.fleet.rollout.spec import RolloutRequest, model_ref, plan_for
from agent.fleet.view.status import collect_fleet
from agent.mqtt.settings import MqttSettings


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
    # The repository takes any uploaded bytes: a file no device can load is refused here, before
    # its canaries pull it (ModelFileError, code bad_model).
    check_model_file(
        model,
        name=f"model {shown(request.model_name, 64)} ({request.model_sha256[:12]})",
        preprocess=request.preprocess,
        postprocess=request.postprocess,
    )
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
    )
    manifest = plan_manifest(plan, job_id, sequence)
    fleet = {row.device: row for row in collect_fleet(settings, max_wait_s=select_wait_s)}
    from_models: dict[str, str | None] = {}
    for device in request.devices:
        slot = fleet[device].slots.get(request.slot) if device in fleet else None
        sha = (slot or {}).get("sha256")
        from_models[device] = (
            model_ref(str(slot.get("model_id")), slot.get("version"), str(sha)) if slot and sha else None
        )
    return request.plan(rollout_id, job_id, sequence, from_models, manifest.model_dump(mode="json"))
