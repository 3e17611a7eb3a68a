"""One realistic instance of every message, used by the docs test and the schema test."""

from __future__ import annotations

from pydantic import BaseModel

from agent.protocol.messages import (
    BackendInfo,
    CommandReply,
    CommandRequest,
    InfoMessage,
    JobEnd,
    JobState,
    JobStatus,
    ModelRef,
    ResultMessage,
    SlotInfo,
    StatusMessage,
    TelemetryMessage,
)
from agent.protocol.results import ClassScore

TS = 1767225600.25
MODEL = ModelRef(slot="main", model_id="mobilenet", version="3", sha256="9f" * 32)

EXAMPLES: dict[str, BaseModel] = {
    "StatusMessage": StatusMessage(
        msg_id="5d0c7c1e", ts=TS, state="online", session=42, agent_version="0.1.0"
    ),
    "InfoMessage": InfoMessage(
        msg_id="b1f2",
        ts=TS,
        device_id="jet-01",
        agent_version="0.1.0",
        platform={"l4t": "36.3.0", "tensorrt": "10.3.0", "cuda": "12.6", "gpu": "Orin", "dla_cores": 2},
        backends={
            "tensorrt": BackendInfo(available=True),
            "onnxruntime": BackendInfo(available=True),
        },
        slots={
            "main": SlotInfo(
                model=MODEL,
                state="active",
                since=TS - 60,
                last_job="job-7",
                last_job_state=JobState.ACTIVE,
                last_failure=JobEnd(
                    job_id="job-6",
                    state=JobState.REJECTED,
                    error_code="unknown_key",
                    error="manifest signed with key id 'fleet-2025', which this device does not trust",
                    ts=TS - 7200,
                ),
                workers=1,
                layout="auto: a live or paced stream: one run over every core for the lowest latency",
            ),
            "aux": SlotInfo(
                state="empty",
                reason="model file /opt/models/aux.onnx not found",
                workers=1,
                layout="configured",
            ),
        },
        streams=["cam0"],
    ),
    "TelemetryMessage": TelemetryMessage.model_validate(
        {"ts": TS, "cam0_fps": 29.8, "main_infer_p95_ms": 7.4, "gpu_temp_c": 51.5, "mqtt_spool_depth": 0}
    ),
    "ResultMessage": ResultMessage(
        msg_id="e7a9",
        ts=TS,
        stream="cam0",
        frame_index=1234,
        captured_at=TS - 0.021,
        published_at=TS,
        model=MODEL,
        latency_ms={"preprocess": 1.9, "infer": 7.1, "postprocess": 0.4, "total": 9.4},
        classes=[ClassScore(index=281, label="tabby cat", score=0.91)],
    ),
    "JobStatus": JobStatus(
        msg_id="0a11",
        ts=TS,
        job_id="job-7",
        slot="main",
        state=JobState.BUILDING,
        progress=0.4,
        bytes_done=14_000_000,
        bytes_total=14_000_000,
        timings_s={"download": 3.2, "verify": 0.1},
        requested={"precision": "int8", "device": "dla0", "gpu_fallback": True},
    ),
    "CommandRequest": CommandRequest(msg_id="c0de", ts=TS, args={"slot": "main"}),
    "CommandReply": CommandReply(
        msg_id="r3p1",
        ts=TS,
        command="rollback",
        ok=False,
        error_code="engine_failed",
        error="no last-known-good",
    ),
}


def _delivery_examples() -> dict[str, BaseModel]:
    # Imported here: the manifest models live in agent.delivery, not agent.protocol.
    from agent.camera.preprocess_spec import PreprocessSpec
    from agent.delivery.manifest import DeployManifest, ModelSourceRef, SignedManifest
    from agent.engines.spec import BuildSpec
    from agent.postprocess.spec import ClassificationSpec

    manifest = DeployManifest(
        job_id="job-8",
        sequence=8,
        device="jet-01",
        slot="main",
        model_id="mobilenet",
        version="4",
        size=600_000,
        sha256="9f" * 32,
        chunk_size=262_144,
        chunks=["a1" * 32, "b2" * 32, "c3" * 32],
        sources=[
            ModelSourceRef(kind="mqtt"),
            ModelSourceRef(kind="http", url="https://models.example.com/mobilenet-4.onnx"),
        ],
        build=BuildSpec(precision="int8", device="dla0", gpu_fallback=True),
        preprocess=PreprocessSpec(width=224, height=224),
        postprocess=ClassificationSpec(top_k=3, labels=["cat", "dog", "bird"]),
        created_at=TS,
    )
    # The signed example wraps a small manifest so the doc stays readable.
    small = DeployManifest(
        job_id="job-9",
        sequence=9,
        slot="main",
        model_id="mobilenet",
        version="5",
        size=1000,
        sha256="9f" * 32,
        chunk_size=262_144,
        chunks=["9f" * 32],
        sources=[ModelSourceRef(kind="mqtt")],
        created_at=TS,
    )
    text = small.model_dump_json(exclude_none=True)
    return {
        "DeployManifest": manifest,
        "SignedManifest": SignedManifest(manifest=text, key_id="fleet-2026", signature="0wD2" * 21 + "AA=="),
    }


#: Delivery payloads that are not MESSAGE_MODELS (their doc examples are checked in tests/delivery/).
DELIVERY_EXAMPLES: dict[str, BaseModel] = _delivery_examples()
