"""Every MQTT message as a pydantic model, plus ``encode``/``decode`` at the wire boundary.

Payloads are compact UTF-8 JSON. ``None`` fields are left out when encoding, so every nullable
field defaults to ``None`` and a decoded message equals the one encoded. Messages that can repeat
(QoS 1 resends, spool replay) carry a ``msg_id``: consumers drop a ``msg_id`` they have already seen.
"""

from __future__ import annotations

import enum
import math
import random
import time
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from agent.errors import AgentError
from agent.model_base import StrictModel
from agent.names import LabelKey, LabelValue
from agent.protocol.device_targets import TargetInfo
from agent.protocol.results import ClassScore, Detection, RawTensor


class ProtocolError(AgentError):
    """A received payload is not a valid message (malformed JSON or the wrong shape)."""

    code = "bad_message"


#: Largest count a message may carry: a signed 64-bit integer, what SQLite and the JSON readers of
#: other languages hold. Python reads any length of digits, and ``str()`` of one past 4,300 digits
#: raises, so an unbounded count from a device crashes whoever prints it.
MAX_COUNT = 2**63 - 1

#: A time or duration (Unix seconds, seconds, milliseconds). JSON parsers accept ``NaN``,
#: ``Infinity`` and ``1e400`` (which overflows to infinity); none of them is a time, and each one
#: crashes or poisons whatever computes with it (``int(nan)`` raises), so they are refused here, once.
FiniteTime = Annotated[float, Field(allow_inf_nan=False)]

#: A count (bytes, frames, sessions, workers): a whole number from 0 to :data:`MAX_COUNT`.
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]


def _new_msg_id() -> str:
    # 128 random bits as 32 hex digits, like uuid4().hex, from the process's Mersenne Twister instead
    # of os.urandom: one id per result is on the frame path, and a syscall per frame shows on a busy
    # CPU. An id only deduplicates, it protects nothing;
    # the generator is seeded from os.urandom and reseeded in a forked child by the random module.
    return f"{random.getrandbits(128):032x}"


class Envelope(StrictModel):
    """Fields every message carries: a unique id for deduplication and the time it was created."""

    msg_id: str = Field(
        default_factory=_new_msg_id,
        min_length=1,
        description="Unique per message; a repeat (QoS 1 resend, spool replay) has the same id.",
    )
    ts: FiniteTime = Field(default_factory=time.time, description="Creation time, Unix seconds.")


# -- up/status -------------------------------------------------------------------------------------


class StatusMessage(Envelope):
    """``up/status`` (retained): online when connected; offline from a graceful stop or the Last Will.

    ``session`` increases with every connection attempt of the device (persisted across restarts).
    A consumer ignores an offline whose session is lower than the last online it saw: that is a
    stale Last Will arriving after the device already reconnected.
    """

    state: Literal["online", "offline"]
    session: Count = Field(description="Connection counter; the Last Will repeats the online's value.")
    agent_version: str


# -- up/info ---------------------------------------------------------------------------------------


class BackendInfo(StrictModel):
    """Whether an inference backend can be used on this device, and if not, why."""

    available: bool
    reason: str = Field("", description="Why unavailable (empty when available).")


class ModelRef(StrictModel):
    """Which model (and which exact bytes) produced something."""

    slot: str
    model_id: str
    version: str | None = None
    sha256: str = Field(description="SHA-256 (hex) of the ONNX model bytes.")


class JobEnd(StrictModel):
    """How one deployment job ended (``up/info``: the slot's last job, and its last failure)."""

    job_id: str
    state: JobState = Field(description="The terminal state: ACTIVE or a failure end.")
    error_code: str | None = None
    error: str | None = Field(None, description="The job's error message, cut to 300 characters.")
    ts: FiniteTime = Field(description="When the job ended, Unix seconds.")


class EngineInfo(StrictModel):
    """One engine of a slot's model (a slot on several devices, ``build.devices``, has one per device)."""

    index: Count = Field(description="Position in the slot's set; worker i runs engine i mod the count.")
    device: str = Field(description="Where it effectively runs: gpu, dla0, dla1 or cpu.")
    precision: str | None = Field(None, description="fp32, fp16 or int8 (absent for a model run as given).")
    dla_layers: Count | None = Field(None, description="Layers TensorRT placed on the DLA (TensorRT only).")
    gpu_layers: Count | None = Field(
        None, description="Layers on the GPU, DLA fallbacks included (TensorRT)."
    )
    requested: str | None = Field(None, description="The device the build asked for, when it was built.")
    frames: Count = Field(0, description="Frames this engine inferred since the model went live.")
    share: float = Field(0.0, ge=0.0, le=1.0, description="Its share of the slot's frames since then.")
    preprocess: Literal["cpu", "gpu"] | None = Field(
        None, description="Where its frames are resized and normalised: gpu (into the engine's input) or cpu."
    )
    preprocess_reason: str | None = Field(
        None, description="Why there: e.g. CuPy missing, an ONNX Runtime engine, or the GPU path in use."
    )


#: Where the engine a slot serves came from: built on the device (or found in its cache), downloaded
#: from the fleet, the ONNX model served meanwhile while it builds, or the ONNX model as given (no build).
EngineSource = Literal["built", "downloaded", "interim", "model"]


class RunsInfo(StrictModel):
    """What a slot's model really runs as against what its build asked for (``up/info`` per slot, a
    job status once its engine is built): the precision asked and running, where the engine came
    from, and why it runs another precision than asked."""

    requested: str | None = Field(
        None, description="The precision the build asked for: fp32, fp16, int8 or best (absent: no build)."
    )
    precision: str | None = Field(
        None, description="The precision that runs: fp32, fp16 or int8 (absent: the ONNX model as given)."
    )
    source: EngineSource = Field(description="built, downloaded, interim or model.")
    fallback: str | None = Field(
        None,
        description="Why it runs another precision than asked (an INT8 engine the accuracy guard refused, "
        "a device that cannot run it), at most 300 characters; absent when it runs what was asked.",
    )


BuildPhaseName = Literal["planning", "slimming", "calibrating", "building", "timing placements", "checking"]


class BuildProgressInfo(StrictModel):
    """A running engine build (agent.engines.building.progress), published at most once per 2 s."""

    phase: BuildPhaseName = Field(description="What the build does now.")
    frames_done: Count | None = Field(None, description="Calibration frames consumed (phase calibrating).")
    frames_total: Count | None = Field(None, description="Calibration frames it will consume.")
    elapsed_s: FiniteTime = Field(ge=0, description="Seconds since the build began.")
    estimate_s: FiniteTime | None = Field(
        None, ge=0, description="Expected seconds in all, from earlier builds of the same fingerprint."
    )


class SlotBuildInfo(BuildProgressInfo):
    """An engine build a slot runs outside any deployment (start-up, config reload)."""

    model_id: str = Field(max_length=200, description="The model whose engine builds.")
    version: str | None = Field(None, max_length=200)
    since: FiniteTime = Field(description="When the build began, Unix seconds.")


class SlotInfo(StrictModel):
    """The state of one model slot."""

    model: ModelRef | None = None
    state: str = Field(description="Slot state: empty, loading, validating or active.")
    reason: str | None = Field(
        None,
        description="Why the slot holds no model (a missing model file, a failed load); absent while "
        "it serves one.",
    )
    since: FiniteTime | None = Field(None, description="When the slot entered ``state``, Unix seconds.")
    last_job: str | None = Field(
        None, description="Id of the last deployment job for this slot, a refused manifest's included."
    )
    last_job_state: JobState | None = Field(
        None, description="Its state: a terminal one once it ended, else the last one recorded."
    )
    last_job_error_code: str | None = Field(None, description="Its error code when it failed.")
    release_revoked: str | None = Field(
        None,
        max_length=400,
        description="Why the model it serves was released under a key the fleet root revoked since "
        "(it keeps serving until re-released and deployed); absent otherwise and without a root.",
    )
    last_failure: JobEnd | None = Field(
        None, description="The last job of the slot that ended FAILED, REJECTED or ROLLED_BACK."
    )
    workers: Count = Field(1, description="Inference workers running the slot's batches side by side.")
    layout: str | None = Field(None, description="Why that many workers: configured, or the auto rule.")
    engines: list[EngineInfo] | None = Field(
        None, description="Each engine of the model it serves (absent while empty), with its measured share."
    )
    serving: Literal["requested", "interim"] | None = Field(
        None,
        description="requested: the model (or built engine) the slot was asked to run; interim: its ONNX "
        "model on ONNX Runtime while that engine builds (engines.serve_while_building). Absent while empty.",
    )
    building: SlotBuildInfo | None = Field(
        None, description="The engine build the slot runs now outside a deployment; absent when none."
    )
    runs: RunsInfo | None = Field(
        None,
        description="Precision asked and running, the engine's source, any fallback; absent while empty.",
    )


class CertificateInfo(StrictModel):
    """The certificate a device connects with, as ``up/info`` reports it (days to expiry follow)."""

    serial: str = Field(max_length=64, description="Serial number, hex.")
    not_after: FiniteTime = Field(description="Expiry, Unix seconds.")
    issuer: str = Field("", max_length=300, description="The issuer's common name.")


#: Longest failure reason of a camera in ``up/info`` (the device cuts its own at 300 characters).
CAMERA_ERROR_CHARS = 1024


class CameraInfo(StrictModel):
    """One camera stream's source as ``up/info`` reports it; live figures are in ``up/telemetry``."""

    state: Literal["idle", "connecting", "streaming", "reconnecting", "ended", "stopped"] = Field(
        description='The source\'s state (docs/cameras.md, "States").'
    )
    since: FiniteTime = Field(description="When the source entered ``state``, Unix seconds.")
    frames: Count = Field(0, description="Frames the source delivered since the agent started.")
    reconnects: Count = Field(
        0, description="Times the source was lost and reopened since the agent started."
    )
    last_error: str | None = Field(
        None,
        max_length=CAMERA_ERROR_CHARS,
        description="Why it was last lost (credentials stripped, at most 300 characters); absent if never.",
    )
    last_error_at: FiniteTime | None = Field(None, description="When that was, Unix seconds.")


class InfoMessage(Envelope):
    """``up/info`` (retained): what the device is and runs."""

    device_id: str
    agent_version: str
    platform: dict[str, str | bool | Count | FiniteTime | None] = Field(
        description="What agent.machine.platform.platform_summary reports: l4t_release, jetpack, "
        "cuda_driver, cuda_runtime, gpu_name, compute_capability, dla_cores, tensorrt_version, "
        "onnxruntime_version, ... "
        "A value that could not be read is null, and <key>_reason says why."
    )
    labels: dict[LabelKey, LabelValue] = Field(
        default_factory=dict,
        description="The device's labels from its config (site, camera, hw, ...), for fleet selectors; "
        "absent from agents before 0.2, read as none.",
    )
    backends: dict[str, BackendInfo]
    slots: dict[str, SlotInfo]
    streams: list[str]
    certificate: CertificateInfo | None = Field(
        None,
        description="The client certificate the device connects with (absent on plain TCP or from "
        "agents before enrollment existed).",
    )
    cameras: dict[str, CameraInfo] = Field(
        default_factory=dict,
        description="Each stream's camera source by stream name: state, counters, last failure; "
        "absent from agents before it existed, read as none.",
    )
    config: TargetInfo | None = Field(
        None,
        description="The device's configuration overlay (target _config): its version, the job that "
        "applied it, one pending, the last reverted; absent on agents that take no overlay.",
    )
    agent_release: TargetInfo | None = Field(
        None,
        description="The agent release it runs (target _agent): version, job, one pending, the last "
        "reverted; absent on agents not installed as releases.",
    )


# -- up/telemetry ----------------------------------------------------------------------------------


#: Largest telemetry value: integers above it do not fit a float (Telegraf and InfluxDB store floats).
_MAX_TELEMETRY = 1e308


class TelemetryMessage(StrictModel):
    """``up/telemetry``: flat numeric JSON, ``ts`` plus any number of finite numeric fields.

    Flat on purpose: Telegraf's json parser turns every numeric field into an InfluxDB/Prometheus
    field without configuration; the device id comes from the topic.
    """

    model_config = ConfigDict(
        extra="allow", frozen=True, json_schema_extra={"additionalProperties": {"type": "number"}}
    )

    ts: FiniteTime = Field(default_factory=time.time, description="Sample time, Unix seconds.")

    @model_validator(mode="after")
    def _extras_are_finite_numbers(self) -> TelemetryMessage:
        for key, value in (self.__pydantic_extra__ or {}).items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                # ValueError, not TypeError: pydantic turns only ValueError into a validation error.
                raise ValueError(f"telemetry field {key!r} must be a number, got {type(value).__name__}")  # noqa: TRY004
            # An integer of hundreds of digits is valid JSON; as a float it is infinite (OverflowError).
            if abs(value) > _MAX_TELEMETRY or not math.isfinite(value):
                raise ValueError(f"telemetry field {key!r} must be finite, of size at most 1e308")
        return self

    def fields(self) -> dict[str, float]:
        """The numeric fields other than ``ts``."""
        return {k: float(v) for k, v in (self.__pydantic_extra__ or {}).items()}


# -- up/results/{stream} ---------------------------------------------------------------------------


class ResultMessage(Envelope):
    """``up/results/{stream}``: what one frame produced; exactly one of classes/detections/tensors is set."""

    stream: str
    frame_index: Count
    captured_at: FiniteTime = Field(description="When the frame was captured, Unix seconds.")
    published_at: FiniteTime = Field(description="When the result was handed to MQTT, Unix seconds.")
    model: ModelRef
    latency_ms: dict[str, FiniteTime] = Field(
        description="Per stage: preprocess, infer, postprocess, total ..."
    )
    classes: list[ClassScore] | None = None
    detections: list[Detection] | None = None
    tensors: list[RawTensor] | None = None


# -- up/jobs/{job_id} ------------------------------------------------------------------------------


class JobState(str, enum.Enum):
    """The steps of a deployment job. ``QUEUED -> DOWNLOADING -> VERIFYING -> BUILDING -> VALIDATING
    -> [SHADOW] -> [PROBATION] -> ACTIVE``; or one of the failure ends. SHADOW (the candidate runs on
    sampled live frames beside the serving model) and PROBATION (it serves, watched against the old
    model's baseline) happen only when the manifest asks for them."""

    QUEUED = "QUEUED"
    DOWNLOADING = "DOWNLOADING"
    VERIFYING = "VERIFYING"
    BUILDING = "BUILDING"
    VALIDATING = "VALIDATING"
    SHADOW = "SHADOW"
    PROBATION = "PROBATION"
    ACTIVE = "ACTIVE"
    FAILED = "FAILED"
    REJECTED = "REJECTED"
    ROLLED_BACK = "ROLLED_BACK"
    SUPERSEDED = "SUPERSEDED"

    @property
    def terminal(self) -> bool:
        """True when the job ends in this state (no further transition is published for it)."""
        return self in TERMINAL_JOB_STATES


#: States after which a job publishes nothing more: success (ACTIVE) and every failure end.
TERMINAL_JOB_STATES: frozenset[JobState] = frozenset(
    {JobState.ACTIVE, JobState.FAILED, JobState.REJECTED, JobState.ROLLED_BACK, JobState.SUPERSEDED}
)


class ShadowFigures(StrictModel):
    """What a shadow run measured: the candidate against the serving model on the same live frames."""

    frames: Count = Field(description="Frames both models ran on.")
    agreement: float | None = Field(
        None,
        description="Mean agreement 0..1: top-1 agreement (classifiers), F1 of boxes matched by class at "
        "IoU >= 0.5 (detectors), cosine similarity (raw tensors).",
    )
    latency_ratio: float | None = Field(None, description="Median candidate / median serving inference time.")
    top5_overlap: float | None = Field(
        None, description="Classifiers: mean share of top-5 classes in common."
    )
    bad_outputs: Count | None = Field(None, description="Frames on which the candidate gave NaN or Inf.")


class EvidenceSummary(StrictModel):
    """The frames a rejected candidate disagreed on most, kept on the device (``evidence`` command)."""

    frames: Count = Field(description="Frames kept, with both models' outputs.")
    bytes: Count = Field(description="Their JPEG bytes in all.")


class FailedFigure(StrictModel):
    """The health figure that ended a probation: its name, its value and the bar it crossed."""

    figure: str = Field(description="e.g. nan_outputs, infer_errors, p99_ratio, fps_ratio.cam0, class_shift.")
    value: float
    bar: float


class ProbationFigures(StrictModel):
    """The new model's live health against the baseline the old one set before the swap."""

    elapsed_s: FiniteTime = Field(description="Seconds since the swap.")
    probation_s: FiniteTime = Field(description="How long the probation lasts.")
    baseline: dict[str, FiniteTime] = Field(default_factory=dict, description="The old model's figures.")
    current: dict[str, FiniteTime] = Field(default_factory=dict, description="The new model's figures.")
    failed: FailedFigure | None = Field(None, description="Set when a figure crossed its bar (ROLLED_BACK).")


class JobStatus(Envelope):
    """``up/jobs/{job_id}`` (spooled, QoS 1): one state transition of a deployment job."""

    job_id: str
    slot: str
    state: JobState
    progress: float | None = Field(None, ge=0.0, le=1.0, description="Fraction done within ``state``.")
    bytes_done: Count | None = None
    bytes_total: Count | None = None
    timings_s: dict[str, FiniteTime] = Field(
        default_factory=dict, description="Seconds spent per finished step."
    )
    requested: dict[str, Any] | None = Field(None, description="What the manifest asked for (BuildSpec).")
    effective: dict[str, Any] | None = Field(None, description="What the backend actually did.")
    error_code: str | None = Field(None, description="Stable code of the error (AgentError.code).")
    error: str | None = Field(None, description="Human-readable error for the operator.")
    shadow: ShadowFigures | None = Field(None, description="Shadow comparison figures, once it ran.")
    probation: ProbationFigures | None = Field(None, description="Probation health figures, once it ran.")
    evidence: EvidenceSummary | None = Field(
        None, description="A rejection's disagreement frames kept on the device (`evidence` command)."
    )
    build: BuildProgressInfo | None = Field(None, description="While BUILDING: phase, elapsed and estimate.")
    runs: RunsInfo | None = Field(
        None,
        description="Once its engine is built: the precision asked and running, its source, any fallback.",
    )


# -- down/cmd/{name}, up/cmd/{name} ----------------------------------------------------------------


class CommandRequest(Envelope):
    """``down/cmd/{name}``: a command; reply to its MQTT 5 response topic with its correlation data."""

    args: dict[str, Any] = Field(default_factory=dict)


class CommandReply(Envelope):
    """``up/cmd/{name}`` (or the request's response topic): the outcome of one command."""

    command: str
    ok: bool
    result: dict[str, Any] | None = None
    error_code: str | None = None
    error: str | None = None


#: Most root versions one :class:`RootChain` carries, and the bytes its message may take.
MAX_ROOT_VERSIONS = 64
MAX_ROOT_CHAIN_BYTES = 1024 * 1024


class RootChain(StrictModel):
    """Retained on ``{prefix}/_trust/root``: every version of the fleet root, oldest first.

    Each item is TUF root metadata as JSON (``{"signed": ..., "signatures": [...]}``). A device takes
    the versions newer than its own one at a time, each only when a threshold of the previous
    version's root keys and of its own signed it (docs/trust.md).
    """

    roots: list[dict[str, Any]] = Field(
        min_length=1, max_length=MAX_ROOT_VERSIONS, description="TUF root metadata, version 1 first."
    )
    adopt_key_id: str | None = Field(
        None, max_length=200, description="A delivery.trusted_keys id whose key signed the first version."
    )
    adopt_signature: str | None = Field(
        None,
        max_length=200,
        description="Base64 Ed25519 signature of the first version's canonical signed bytes: a device "
        "without a root that trusts that key adopts the root (docs/trust.md, moving to a root).",
    )


class ControllerLease(StrictModel):
    """``{p}/_controller/lease`` (retained): the controller that holds the prefix (docs/protocol.md).

    Written by the holder only; an empty retained message (its Last Will, or its release at stop)
    means nobody holds the prefix.
    """

    holder: str = Field(min_length=1, max_length=200, description="The holding process: host:pid:random.")
    host: str = Field(max_length=255, description="Host name of the holder.")
    pid: int = Field(ge=1, le=2**31, description="Process id of the holder on its host.")
    state_dir: str = Field(max_length=4096, description="The holder's state directory.")
    since: FiniteTime = Field(description="When the holder took the lease, Unix seconds.")
    ttl_s: int = Field(ge=1, le=86_400, description="The claim expires this long after its last renewal.")


#: Every message model, by name (schema export and docs use this list).
MESSAGE_MODELS: tuple[type[BaseModel], ...] = (
    StatusMessage,
    InfoMessage,
    TelemetryMessage,
    ResultMessage,
    JobStatus,
    CommandRequest,
    CommandReply,
)

M = TypeVar("M", bound=BaseModel)


def encode(message: BaseModel) -> bytes:
    """Compact UTF-8 JSON of ``message``, ``None`` fields left out."""
    return message.model_dump_json(exclude_none=True).encode()


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False):
        path = ".".join(str(p) for p in err["loc"]) or "(message)"
        parts.append(f"{path}: {err['msg']}")
    return "; ".join(parts)


def decode(model_cls: type[M], payload: bytes) -> M:
    """Parse ``payload`` as ``model_cls``; raise ProtocolError saying what was wrong and where."""
    try:
        return model_cls.model_validate_json(payload)
    except ValidationError as exc:
        name = model_cls.__name__
        if any(err["type"] == "json_invalid" for err in exc.errors(include_url=False)):
            raise ProtocolError(f"{name}: payload is not valid JSON ({_describe(exc)})") from exc
        if any(err["type"] == "model_type" and not err["loc"] for err in exc.errors(include_url=False)):
            raise ProtocolError(f"{name}: payload must be a JSON object ({_describe(exc)})") from exc
        raise ProtocolError(f"{name}: wrong shape: {_describe(exc)}") from exc
