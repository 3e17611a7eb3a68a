"""DeliveryService in process: a real broker, a real MqttLink + spool, real keys, real ONNX models.

The operator side is a plain paho probe; job status is read off ``up/jobs/{job_id}`` as a fleet
dashboard would. Each bad input checks the code published AND that no state file changed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.demo.modelzoo import write_classifier
from agent.errors import DeliveryError
from agent.protocol.manifest import SignedManifest
from agent.protocol.messages import JobState
from agent.store import DiskUsage
from tests.delivery.conftest import HarnessFactory
from tests.delivery.delivery_stack import HAPPY_PATH, SLOT, Harness, make_keys, states
from tests.runtime.models import write_checker_failure
from tests.waiting import patient, wait_until


def _deploy_ok(device: Harness, model: Path, *, sequence: int = 1, job_id: str | None = None) -> str:
    manifest = device.manifest(model, sequence=sequence, job_id=job_id)
    device.deploy(device.signed(manifest))
    statuses = device.wait_terminal(manifest.job_id)
    assert states(statuses) == HAPPY_PATH, [s.model_dump(exclude_none=True) for s in statuses]
    return manifest.job_id


def test_deploy_publishes_every_step_and_activates(device: Harness, model_v1: Path) -> None:
    manifest = device.manifest(model_v1, sequence=1, job_id="job-happy")
    device.deploy(device.signed(manifest))
    statuses = device.wait_terminal("job-happy")

    assert states(statuses) == HAPPY_PATH
    downloading = [s for s in statuses if s.state is JobState.DOWNLOADING]
    assert downloading[0].bytes_done == 0
    assert downloading[-1].bytes_done == manifest.size
    assert all(s.bytes_total == manifest.size for s in downloading)
    assert [s.progress for s in downloading] == sorted(s.progress or 0.0 for s in downloading)
    final = statuses[-1]
    assert set(final.timings_s) == {"download", "verify", "build", "validate"}
    assert final.requested is None  # the manifest asked for no engine build
    assert final.effective == {"backend": "onnxruntime", "precision": "fp32", "device": "cpu"}
    assert final.error_code is None
    assert len({s.msg_id for s in statuses}) == len(statuses)

    [request] = device.activations.requests
    assert (request.slot, request.model_id, request.version, request.sha256) == (
        SLOT,
        "cls",
        "1",
        manifest.sha256,
    )
    assert request.backend == "onnxruntime"
    assert request.model_path == device.store.path_for(manifest.sha256)
    assert request.model_path.read_bytes() == model_v1.read_bytes()
    assert request.preprocess is None
    assert request.postprocess is None
    assert device.jobs_json()["slots"][SLOT]["state"] == "ACTIVE"
    assert device.service.last_job(SLOT) == "job-happy"
    assert not list((device.state_dir / "partial").iterdir())  # the part file moved into the store


def test_build_request_is_published_as_requested(device: Harness, model_v1: Path) -> None:
    from agent.specs.build import BuildSpec

    manifest = device.manifest(model_v1, build=BuildSpec(precision="int8", device="dla0"))
    device.deploy(device.signed(manifest))
    statuses = device.wait_terminal(manifest.job_id)
    assert statuses[-1].state is JobState.ACTIVE
    assert statuses[-1].requested is not None
    assert statuses[-1].requested["precision"] == "int8"
    assert statuses[-1].requested["device"] == "dla0"
    # The default builder did not build: requested differs from effective, and both are published.
    assert statuses[-1].effective == {"backend": "onnxruntime", "precision": "fp32", "device": "cpu"}


# -- bad manifests: refused before any job starts ---------------------------------------------------


def _tamper(payload: bytes) -> bytes:
    envelope = SignedManifest.model_validate_json(payload)
    body = json.loads(envelope.manifest)
    body["version"] = "evil"
    return envelope.model_copy(update={"manifest": json.dumps(body)}).model_dump_json().encode()


def _other_key(device: Harness, payload: bytes) -> bytes:
    from agent.signing import sign

    envelope = SignedManifest.model_validate_json(payload)
    stranger = make_keys(device.state_dir.parent / "stranger")
    import base64

    sig = base64.b64encode(sign(stranger.private, envelope.manifest.encode())).decode()
    return envelope.model_copy(update={"signature": sig}).model_dump_json().encode()


@pytest.mark.parametrize(
    ("case", "code"),
    [
        ("malformed_json", "bad_json"),
        ("wrong_shape", "bad_manifest"),
        ("wrong_signature", "bad_signature"),
        ("signed_by_stranger", "bad_signature"),
        ("unknown_key_id", "unknown_key"),
        ("unsigned", "unsigned"),
        ("slot_with_dotdot", "bad_name"),
        ("model_id_with_slash", "bad_name"),
        ("version_with_backslash", "bad_name"),
        ("other_device", "wrong_device"),
        ("slot_mismatch", "wrong_slot"),
    ],
)
def test_bad_manifest_is_rejected_and_changes_nothing(
    make_device: HarnessFactory, model_v1: Path, model_v2: Path, case: str, code: str
) -> None:
    device = make_device()
    good = _deploy_ok(device, model_v1, sequence=1)
    before = device.state_files()
    job_id = f"job-{case.replace('_', '-')}"
    m = device.manifest(model_v2, sequence=2, job_id=job_id)
    signed = device.signed(m)
    payloads = {
        "malformed_json": b'{"manifest": "{\\"job_id\\": \\"' + job_id.encode() + b'\\", ',
        "wrong_shape": sign_dict(device, {**m.model_dump(mode="json"), "chunks": ["00" * 32]}),
        "wrong_signature": _tamper(signed),
        "signed_by_stranger": _other_key(device, signed),
        "unknown_key_id": signed.replace(b'"key_id":"fleet-test"', b'"key_id":"fleet-2019"'),
        "unsigned": SignedManifest(manifest=m.model_dump_json()).model_dump_json(exclude_none=True).encode(),
        "slot_with_dotdot": sign_dict(device, {**m.model_dump(mode="json"), "slot": "../main"}),
        "model_id_with_slash": sign_dict(device, {**m.model_dump(mode="json"), "model_id": "a/../../etc"}),
        "version_with_backslash": sign_dict(device, {**m.model_dump(mode="json"), "version": "..\\x"}),
        "other_device": device.signed(m.model_copy(update={"device": "someone-else"})),
        "slot_mismatch": device.signed(m.model_copy(update={"slot": "other"})),
    }
    device.deploy(payloads[case], slot=SLOT)
    if case == "malformed_json":
        # No job id can be read from it: logged, nothing published, nothing changed.
        device.probe.settle(0.5)
        assert device.probe.on_topic(device.topics.jobs(job_id)) == []
    else:
        statuses = device.wait_terminal(job_id)
        assert [s.state for s in statuses] == [JobState.REJECTED]
        assert statuses[0].error_code == code, statuses[0].error
        assert statuses[0].error
    assert device.state_files() == before
    assert len(device.activations.requests) == 1
    assert device.service.last_job(SLOT) == good
    # The device still converges to a good new manifest afterwards.
    _deploy_ok(device, model_v2, sequence=3)


def sign_dict(device: Harness, body: dict[str, object]) -> bytes:
    """A correctly signed envelope around an arbitrary (possibly invalid) manifest body."""
    import base64

    from agent.signing import sign

    text = json.dumps(body)
    sig = base64.b64encode(sign(device.keys.private, text.encode())).decode()
    return SignedManifest(manifest=text, key_id="fleet-test", signature=sig).model_dump_json().encode()


def test_unsigned_accepted_only_when_config_allows(make_device: HarnessFactory, model_v1: Path) -> None:
    device = make_device(config={"require_signature": False})
    m = device.manifest(model_v1, job_id="job-unsigned")
    device.deploy(SignedManifest(manifest=m.model_dump_json()).model_dump_json(exclude_none=True).encode())
    assert states(device.wait_terminal("job-unsigned")) == HAPPY_PATH


def test_replayed_old_sequence_is_rejected(device: Harness, model_v1: Path, model_v2: Path) -> None:
    _deploy_ok(device, model_v1, sequence=5, job_id="job-5")
    before = device.state_files()
    for job_id, sequence in (("job-old", 4), ("job-equal", 5)):
        device.deploy(device.signed(device.manifest(model_v2, sequence=sequence, job_id=job_id)))
        [status] = device.wait_terminal(job_id)
        assert (status.state, status.error_code) == (JobState.REJECTED, "replay")
        assert "not newer than 5" in (status.error or "")
    assert device.state_files() == before
    assert len(device.activations.requests) == 1


def test_an_old_finished_manifest_republished_is_ignored_not_rejected_even_after_a_restart(
    make_device: HarnessFactory, tmp_path: Path, model_v1: Path, model_v2: Path
) -> None:
    """One terminal state per job id: job-a ended ACTIVE, so its manifest again is not a REJECTED replay."""
    state_dir = tmp_path / "state-old"
    device = make_device(state_dir=state_dir)
    old = device.signed(device.manifest(model_v1, sequence=1, job_id="job-a"))
    device.deploy(old)
    device.wait_terminal("job-a")
    _deploy_ok(device, model_v2, sequence=2, job_id="job-b")
    count = len(device.statuses("job-a"))
    device.deploy(old)  # an operator re-publishes the old manifest by hand
    device.probe.settle(0.5)
    assert [s.state for s in device.statuses("job-a")][count:] == []
    device.stop()

    restarted = make_device(state_dir=state_dir, device_id=device.device_id)
    restarted.deploy(old)
    restarted.probe.settle(0.5)
    assert restarted.statuses("job-a") == []
    assert restarted.repo.fetched == []


def test_one_manifest_on_several_wrong_slot_topics_is_rejected_once(
    make_device: HarnessFactory, tmp_path: Path, model_v1: Path
) -> None:
    state_dir = tmp_path / "state-wrong"
    device = make_device(state_dir=state_dir)
    payload = device.signed(device.manifest(model_v1, job_id="job-lost"))
    for topic_slot in ("cam-a", "cam-b", "cam-c", "cam-d"):
        device.probe.publish(device.topics.desired(topic_slot), payload)  # not retained: nothing left over
    [status] = device.wait_terminal("job-lost")
    device.probe.settle(0.5)
    assert [(s.state, s.error_code) for s in device.statuses("job-lost")] == [
        (JobState.REJECTED, "wrong_slot")
    ]
    assert "cam-a" in (status.error or "")
    # Its job id has its end: the same manifest on the right topic is ignored, not run after a REJECTED.
    device.deploy(payload)
    device.probe.settle(0.5)
    assert len(device.statuses("job-lost")) == 1
    assert device.repo.fetched == []
    device.stop()
    restarted = make_device(state_dir=state_dir, device_id=device.device_id)
    restarted.probe.publish(restarted.topics.desired("cam-a"), payload)
    restarted.probe.settle(0.5)
    assert restarted.statuses("job-lost") == []


def test_a_known_job_id_under_another_sequence_gets_no_second_end(device: Harness, model_v1: Path) -> None:
    manifest = device.manifest(model_v1, sequence=3, job_id="job-twice")
    device.deploy(device.signed(manifest))
    ended = device.wait_terminal("job-twice")
    device.deploy(device.signed(manifest.model_copy(update={"sequence": 1})))
    device.probe.settle(0.5)
    assert device.statuses("job-twice") == ended


def test_same_job_again_does_nothing(device: Harness, model_v1: Path) -> None:
    manifest = device.manifest(model_v1, job_id="job-once")
    payload = device.signed(manifest)
    device.deploy(payload)
    device.wait_terminal("job-once")
    count = len(device.statuses("job-once"))
    device.deploy(payload)  # a QoS 1 repeat, or the retained message after a reconnect
    device.probe.settle(0.5)
    assert len(device.statuses("job-once")) == count
    assert len(device.activations.requests) == 1
    assert device.repo.fetched == ["job-once"]


# -- bad models: refused in VERIFYING, the slot untouched ---------------------------------------


@pytest.mark.parametrize(
    ("case", "state", "code"),
    [
        ("truncated_onnx", JobState.REJECTED, "bad_onnx"),
        ("checker_failure", JobState.REJECTED, "onnx_checker"),
        ("input_shape_mismatch", JobState.REJECTED, "incompatible"),
        ("too_large", JobState.REJECTED, "too_large"),
        ("hash_mismatch", JobState.REJECTED, "hash_mismatch"),
        ("fetch_failure", JobState.FAILED, "delivery_failed"),
        ("activation_failure", JobState.ROLLED_BACK, "engine_failed"),
    ],
)
def test_bad_model_fails_the_job_and_keeps_the_slot(
    make_device: HarnessFactory,
    tmp_path: Path,
    model_v1: Path,
    model_v2: Path,
    case: str,
    state: JobState,
    code: str,
) -> None:
    limit = {"max_model_bytes": model_v2.stat().st_size - 1} if case == "too_large" else {}
    device = make_device(config=limit)
    bad = tmp_path / "bad.onnx"
    good_job = _deploy_ok(device, model_v1 if case != "too_large" else _small(tmp_path), sequence=1)
    before = device.state_files()
    if case == "truncated_onnx":
        bad.write_bytes(model_v2.read_bytes()[: model_v2.stat().st_size // 2])
    elif case == "checker_failure":
        write_checker_failure(bad)
    elif case == "input_shape_mismatch":
        write_classifier(bad, input_size=96, seed=3)  # the slot feeds 64x64
    else:
        bad = model_v2
    manifest = device.manifest(bad, sequence=2, job_id=f"job-{case.replace('_', '-')}")
    if case == "hash_mismatch":
        # The bytes that arrive are another model's: every chunk "arrived", the whole file is wrong.
        device.repo.files[manifest.sha256] = model_v1
    if case == "fetch_failure":
        device.repo.fail = DeliveryError("chunks never answered within the deadline")
    if case == "activation_failure":
        device.activations.fail = "output 'scores' has NaN values on a real frame"
    device.deploy(device.signed(manifest))
    statuses = device.wait_terminal(manifest.job_id)

    assert statuses[-1].state is state
    assert statuses[-1].error_code == code, statuses[-1].error
    assert statuses[-1].error
    assert len(device.activations.requests) == 1  # nothing new went live
    record = device.jobs_json()["slots"][SLOT]
    assert (record["job_id"], record["state"]) == (manifest.job_id, state.value)
    after = device.state_files()
    # Only jobs.json changed (the job is recorded as done), and any refused model file is gone again
    # or never entered the store; the active model's file is untouched.
    active = f"models/{device.activations.requests[0].sha256}.onnx"
    assert after[active] == before[active]
    assert set(after) - {"jobs.json"} <= set(before) | {f"models/{manifest.sha256}.onnx"}
    assert not any(name.startswith("partial/") and after[name] for name in set(after) - set(before))
    json.loads(after["jobs.json"])
    assert device.service.last_job(SLOT) == manifest.job_id != good_job
    if case == "hash_mismatch":
        assert not device.store.has(manifest.sha256)


def _small(tmp_path: Path) -> Path:
    return write_classifier(tmp_path / "small.onnx", input_size=64, width=2, seed=9)


def test_disk_too_small_fails_before_download(make_device: HarnessFactory, model_v1: Path) -> None:
    """The free-space number is a test double (a full disk is hardware); the check and message are real."""
    free = {"bytes": 10**12}

    def disk_usage(path: Path) -> DiskUsage:
        return DiskUsage(total=10**12, used=10**12 - free["bytes"], free=free["bytes"])

    device = make_device(disk_usage=disk_usage, config={"disk_headroom_bytes": 1000})
    manifest = device.manifest(model_v1, job_id="job-disk")
    free["bytes"] = manifest.size  # the model fits, the headroom does not
    device.deploy(device.signed(manifest))
    statuses = device.wait_terminal("job-disk")
    assert [s.state for s in statuses] == [JobState.QUEUED, JobState.FAILED]
    assert statuses[-1].error_code == "disk_full"
    assert "need" in (statuses[-1].error or "")
    assert "free" in (statuses[-1].error or "")
    assert device.repo.fetched == []
    assert list(device.state_files()) == ["jobs.json"]
    # Retryable: a new manifest after space was freed succeeds.
    free["bytes"] = 10**12
    _deploy_ok(device, model_v1, sequence=2)


# -- reconcile: supersede, retry, resume ----------------------------------------------------------


def test_newer_manifest_supersedes_a_running_job(device: Harness, model_v1: Path, model_v2: Path) -> None:
    device.repo.hold.add("job-slow")
    first = device.manifest(model_v1, sequence=1, job_id="job-slow")
    device.deploy(device.signed(first))
    assert device.repo.waiting.wait(patient(10)), "first download never started"
    second = device.manifest(model_v2, sequence=2, job_id="job-fast")
    device.deploy(device.signed(second))

    first_statuses = device.wait_terminal("job-slow")
    assert first_statuses[-1].state is JobState.SUPERSEDED
    assert first_statuses[-1].error_code == "superseded"
    assert "job-fast" in (first_statuses[-1].error or "")
    assert states(device.wait_terminal("job-fast")) == HAPPY_PATH
    assert [r.sha256 for r in device.activations.requests] == [second.sha256]
    assert device.jobs_json()["slots"][SLOT]["job_id"] == "job-fast"


def test_failed_job_is_retried_only_by_a_new_manifest(device: Harness, model_v1: Path) -> None:
    device.repo.fail = DeliveryError("no chunk server answered")
    manifest = device.manifest(model_v1, sequence=1, job_id="job-a")
    payload = device.signed(manifest)
    device.deploy(payload)
    assert device.wait_terminal("job-a")[-1].state is JobState.FAILED
    device.repo.fail = None
    device.deploy(payload)  # the same manifest again: already done (failed), nothing happens
    device.probe.settle(0.5)
    assert device.repo.fetched == ["job-a"]
    _deploy_ok(device, model_v1, sequence=2, job_id="job-b")


def test_interrupted_job_resumes_after_restart(
    make_device: HarnessFactory, tmp_path: Path, model_v1: Path
) -> None:
    state_dir = tmp_path / "state-resume"
    first = make_device(state_dir=state_dir)
    first.repo.hold.add("job-resume")
    manifest = first.manifest(model_v1, job_id="job-resume")
    first.deploy(first.signed(manifest))
    assert first.repo.waiting.wait(patient(10))
    first.stop()  # the agent stops mid-download: no terminal state, the job stays open
    assert first.statuses("job-resume")[-1].state is JobState.DOWNLOADING
    # Every state is recorded before it is published: the ledger knows where the job stopped.
    assert first.jobs_json()["slots"][SLOT]["state"] == "DOWNLOADING"

    # A new agent process on the same state dir: the retained manifest arrives on subscribe.
    second = make_device(state_dir=state_dir, device_id=first.device_id, start=False)
    second.repo.files.update(first.repo.files)
    second.start()
    statuses = second.wait_terminal("job-resume")
    assert statuses[-1].state is JobState.ACTIVE
    assert second.jobs_json()["slots"][SLOT]["state"] == "ACTIVE"


def test_an_interrupted_job_whose_manifest_was_replaced_while_down_ends_superseded(
    make_device: HarnessFactory, tmp_path: Path, model_v1: Path, model_v2: Path
) -> None:
    """Issue 19.5: one terminal state per job id, also for a job that can no longer resume."""
    state_dir = tmp_path / "state-replaced"
    first = make_device(state_dir=state_dir)
    first.repo.hold.add("job-old")
    old = first.manifest(model_v1, sequence=1, job_id="job-old")
    first.deploy(first.signed(old))
    assert first.repo.waiting.wait(patient(10))
    first.stop()  # mid-download: the job stays open in jobs.json
    assert first.jobs_json()["slots"][SLOT]["state"] == "DOWNLOADING"
    new = first.manifest(model_v2, sequence=2, job_id="job-new")
    first.deploy(first.signed(new))  # retained while the agent is down: replaces job-old's manifest

    second = make_device(state_dir=state_dir, device_id=first.device_id, start=False)
    second.repo.files.update(first.repo.files)
    second.start()
    assert states(second.wait_terminal("job-new")) == HAPPY_PATH
    [ended] = second.statuses("job-old")
    assert (ended.state, ended.error_code) == (JobState.SUPERSEDED, "superseded")
    assert "job-new" in (ended.error or "")
    assert "job-old" in second.jobs_json()["ended"]
    assert second.activations.requests[-1].sha256 == new.sha256

    # Its manifest published again by hand: ignored, not a second end (REJECTED as a replay).
    second.deploy(second.signed(old))
    second.probe.settle(0.5)
    assert [s.state for s in second.statuses("job-old")] == [JobState.SUPERSEDED]


def test_a_job_superseded_while_running_gets_no_second_end_when_its_manifest_returns(
    device: Harness, model_v1: Path, model_v2: Path
) -> None:
    device.repo.hold.add("job-slow")
    first = device.manifest(model_v1, sequence=1, job_id="job-slow")
    device.deploy(device.signed(first))
    assert device.repo.waiting.wait(patient(10)), "first download never started"
    device.deploy(device.signed(device.manifest(model_v2, sequence=2, job_id="job-fast")))
    assert device.wait_terminal("job-slow")[-1].state is JobState.SUPERSEDED
    device.wait_terminal("job-fast")
    assert "job-slow" in device.jobs_json()["ended"]

    device.deploy(device.signed(first))  # re-published by hand: an older sequence
    device.probe.settle(0.5)
    assert [s.state for s in device.statuses("job-slow")].count(JobState.SUPERSEDED) == 1
    assert not any(s.state is JobState.REJECTED for s in device.statuses("job-slow"))


def test_a_finished_job_is_published_again_from_its_record_and_never_runs_again(
    make_device: HarnessFactory, tmp_path: Path, model_v1: Path
) -> None:
    state_dir = tmp_path / "state-done"
    first = make_device(state_dir=state_dir)
    manifest = first.manifest(model_v1, job_id="job-done")
    first.deploy(first.signed(manifest))
    active = first.wait_terminal("job-done")[-1]
    first.stop()
    recorded = first.jobs_json()["slots"][SLOT]
    assert (recorded["state"], recorded["status"]["msg_id"]) == ("ACTIVE", active.msg_id)

    # Restarted on the same state dir, with the retained manifest still there.
    second = make_device(state_dir=state_dir, device_id=first.device_id, start=False)
    second.repo.files.update(first.repo.files)
    second.start()
    second.probe.wait_for(lambda _ms: len(second.statuses("job-done")) >= 1, timeout=10)
    second.probe.settle(1.0)
    again = second.statuses("job-done")
    assert [(s.state, s.msg_id) for s in again] == [(JobState.ACTIVE, active.msg_id)]  # a duplicate
    assert second.repo.fetched == []
    assert second.activations.requests == []


def test_retained_manifest_applied_on_connect(make_device: HarnessFactory, model_v1: Path) -> None:
    device = make_device(start=False)
    manifest = device.manifest(model_v1, job_id="job-early")
    device.deploy(device.signed(manifest))  # published while the device is offline
    device.start()
    assert states(device.wait_terminal("job-early")) == HAPPY_PATH


def test_store_keeps_active_and_collects_old_models(make_device: HarnessFactory, tmp_path: Path) -> None:
    device = make_device(config={"keep_models": 1})
    shas = []
    for seq in range(1, 5):
        model = write_classifier(tmp_path / f"gc{seq}.onnx", input_size=64, seed=10 + seq)
        m = device.manifest(model, sequence=seq)
        device.deploy(device.signed(m))
        assert device.wait_terminal(m.job_id)[-1].state is JobState.ACTIVE
        shas.append(m.sha256)
    stored = set(device.store.models())
    # Without an injected protect(): the last job's model plus keep_models=1 others.
    assert shas[-1] in stored
    assert len(stored) == 2


def test_info_fields_show_the_last_job_a_refused_one_included_and_the_last_failure(
    device: Harness, model_v1: Path, model_v2: Path
) -> None:
    good = _deploy_ok(device, model_v1, sequence=1, job_id="job-good")
    fields = device.service.job_fields(SLOT)
    assert (fields["last_job"], fields["last_job_state"], fields["last_failure"]) == (
        good,
        JobState.ACTIVE,
        None,
    )
    ends = len(device.job_ends)
    unsigned = device.manifest(model_v2, sequence=2, job_id="job-unsigned")
    device.deploy(
        SignedManifest(manifest=unsigned.model_dump_json()).model_dump_json(exclude_none=True).encode()
    )
    device.wait_terminal("job-unsigned")
    # The end is noted just after it is published: the probe may see it first.
    wait_until(lambda: len(device.job_ends) > ends, 10, "the refusal to be noted")

    # The ledger still names the good job (the refused one must not bound replays) ...
    assert device.service.last_job(SLOT) == good
    # ... but up/info says what the operator needs: the last job was refused, and why.
    fields = device.service.job_fields(SLOT)
    assert (fields["last_job"], fields["last_job_state"], fields["last_job_error_code"]) == (
        "job-unsigned",
        JobState.REJECTED,
        "unsigned",
    )
    failure = fields["last_failure"]
    assert (failure.job_id, failure.state, failure.error_code) == (
        "job-unsigned",
        JobState.REJECTED,
        "unsigned",
    )
    assert failure.error
    assert device.job_ends[ends:] == [SLOT]  # the agent is told, to republish up/info

    later = _deploy_ok(device, model_v2, sequence=3, job_id="job-later")
    fields = device.service.job_fields(SLOT)
    assert (fields["last_job"], fields["last_job_state"]) == (later, JobState.ACTIVE)
    assert fields["last_failure"].job_id == "job-unsigned"  # the last failure stays in view


def test_info_fields_name_the_running_job_not_the_one_it_superseded(
    device: Harness, model_v1: Path, model_v2: Path
) -> None:
    device.repo.hold.update({"job-slow", "job-next"})
    device.deploy(device.signed(device.manifest(model_v1, sequence=1, job_id="job-slow")))
    assert device.repo.waiting.wait(patient(10)), "first download never started"
    device.deploy(device.signed(device.manifest(model_v2, sequence=2, job_id="job-next")))
    slow = device.topics.jobs("job-slow")
    device.probe.wait_for(lambda ms: any(b'"SUPERSEDED"' in m.payload for m in ms if m.topic == slow), 10)
    nxt = device.topics.jobs("job-next")
    device.probe.wait_for(lambda ms: any(b'"DOWNLOADING"' in m.payload for m in ms if m.topic == nxt), 10)
    # job-slow's end is the newest end, but job-next (accepted, running: the ledger records each of
    # its states first) is the slot's last job.
    fields = device.service.job_fields(SLOT)
    assert (fields["last_job"], fields["last_job_state"], fields["last_failure"]) == (
        "job-next",
        JobState.DOWNLOADING,
        None,
    )
    device.deploy(device.signed(device.manifest(model_v2, sequence=3, job_id="job-end")))
    assert states(device.wait_terminal("job-end")) == HAPPY_PATH


def test_an_idle_service_sleeps_until_there_is_work_and_stop_wakes_every_thread(
    make_device: HarnessFactory, model_v1: Path
) -> None:
    """The upkeep, the slot's lane and the link's dispatcher wait without a timeout while idle (a
    thousand simulated devices paid their idle turns: bench/fleetsim_idle.py); stop must wake them."""
    device = make_device()
    manifest = device.manifest(model_v1, job_id="job-idle")
    device.deploy(device.signed(manifest))
    assert states(device.wait_terminal("job-idle")) == HAPPY_PATH
    service = device.service
    assert not service._upkeep_due()  # nothing held, unrecorded or waiting for space: the upkeep sleeps
    upkeep, lane = service._upkeep, service._lanes[SLOT].thread
    assert upkeep is not None
    assert upkeep.is_alive()
    assert lane.is_alive()

    device.stop()

    assert not upkeep.is_alive()
    assert not lane.is_alive()
    assert not device.link._dispatcher.alive()


def test_a_device_serving_no_target_refuses_config_as_a_slot_it_lacks(
    make_device: HarnessFactory, model_v1: Path
) -> None:
    device = make_device()
    _deploy_ok(device, model_v1, sequence=1)
    before = device.state_files()
    m = device.manifest(model_v1, sequence=2, job_id="job-config").model_copy(update={"slot": "_config"})
    device.deploy(device.signed(m), slot="_config")
    statuses = device.wait_terminal("job-config")
    assert [(s.state, s.error_code) for s in statuses] == [(JobState.REJECTED, "wrong_slot")]
    assert "does not serve the target '_config'" in (statuses[0].error or "")
    assert device.state_files() == before
    assert len(device.activations.requests) == 1  # the good deploy's alone
