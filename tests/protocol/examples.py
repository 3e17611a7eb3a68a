"""One realistic instance of every message, used by the docs test and the schema test."""

from __future__ import annotations

from pydantic import BaseModel

from agent.protocol.device_targets import TargetInfo
from agent.protocol.messages import (
    BackendInfo,
    CameraInfo,
    CommandReply,
    CommandRequest,
    EngineInfo,
    InfoMessage,
    JobEnd,
    JobState,
    JobStatus,
    ModelRef,
    ResultMessage,
    RunsInfo,
    SlotInfo,
    StatusMessage,
    TelemetryMessage,
)
from agent.protocol.results import ClassScore
from agent.protocol.runs import runs_of

TS = 1767225600.25
MODEL = ModelRef(slot="main", model_id="mobilenet", version="3", sha256="9f" * 32)

ORT_REASON = "ONNX Runtime 1.20.0, providers: CUDAExecutionProvider, CPUExecutionProvider"

#: ``up/info``'s platform as an Orin that read every value reports it
#: (agent.machine.platform.platform_summary).
JETSON_PLATFORM: dict[str, str | bool | int | float | None] = {
    "is_jetson": True,
    "machine": "aarch64",
    "device_model": "NVIDIA Jetson AGX Orin Developer Kit",
    "soc": "tegra234",
    "soc_family": "Orin",
    "l4t_release": "R36.4.0",
    "jetpack": "6.1",
    "cuda_driver": "12.6",
    "cuda_runtime": "12.6",
    "gpu_name": "Orin",
    "compute_capability": "8.7",
    "dla_cores": 2,
    "tensorrt_version": "10.3.0",
    "onnxruntime_version": "1.20.0",
    "ort_providers": "CUDAExecutionProvider,CPUExecutionProvider",
    "backend_onnxruntime": True,
    "backend_onnxruntime_reason": ORT_REASON,
    "backend_tensorrt": True,
    "backend_tensorrt_reason": "TensorRT 10.3.0, DLA cores: 2",
}

#: What ``fleet deploy --precision fp32 --engine-device cpu`` puts in the manifest, and so what the device
#: publishes as ``requested``: the whole BuildSpec.
REQUESTED = {
    "precision": "fp32",
    "device": "cpu",
    "gpu_fallback": True,
    "workspace_mb": 1024,
    "optimization_level": 3,
    "profiles": [],
    "ep_context": "embed",
    "trt_context_memory_sharing": False,
    "slim": True,
    "prefer": "throughput",
    "fallback": "onnxruntime",
}

#: What the engine service reports for that request on ONNX Runtime
#: (agent.engines.building.artifact.artifact_of).
EFFECTIVE = {
    "backend": "onnxruntime",
    "precision": "fp32",
    "device": "cpu",
    "dla_core": None,
    "gpu_fallback": False,
    "int8_mode": "none",
    "requested": {"precision": "fp32", "device": "cpu"},
    "changes": [
        {
            "field": "backend",
            "requested": "auto",
            "effective": "onnxruntime",
            "reason": "device cpu: TensorRT runs on GPU or DLA only",
        }
    ],
    "built_seconds": 0.48,
    "engine_bytes": 13987002,
    "slim": {
        "path": f"/var/lib/edge-agent/slim/{'9f' * 32}-onnxslim0.1.98.onnx",
        "nodes_before": 112,
        "nodes_after": 97,
        "onnxslim_version": "0.1.98",
        "cached": False,
    },
    "providers": ["CPUExecutionProvider"],
    "placement": {"providers": ["CPUExecutionProvider"]},
    "engine_source": {"origin": "built", "seconds": 0.48, "key": "d24e70d098fa"},
}

EXAMPLES: dict[str, BaseModel] = {
    "StatusMessage": StatusMessage(
        msg_id="5d0c7c1e", ts=TS, state="online", session=42, agent_version="0.1.0"
    ),
    "InfoMessage": InfoMessage(
        msg_id="b1f2",
        ts=TS,
        device_id="jet-01",
        agent_version="0.1.0",
        platform=JETSON_PLATFORM,
        labels={"site": "berlin-3", "camera": "dock", "hw": "orin-nx"},
        backends={
            "tensorrt": BackendInfo(available=True, reason="TensorRT 10.3.0, DLA cores: 2"),
            "onnxruntime": BackendInfo(available=True, reason=ORT_REASON),
        },
        slots={
            "main": SlotInfo(
                model=MODEL,
                state="active",
                since=TS - 60,
                last_job="job-8",
                last_job_state=JobState.REJECTED,
                last_job_error_code="unknown_key",
                last_failure=JobEnd(
                    job_id="job-8",
                    state=JobState.REJECTED,
                    error_code="unknown_key",
                    error="manifest signed with key id 'fleet-2025', which this device does not trust",
                    ts=TS - 7200,
                ),
                workers=1,
                layout="auto: a live or paced stream: one run over every core for the lowest latency",
                engines=[
                    EngineInfo(
                        index=0,
                        device="cpu",
                        precision="fp32",
                        requested="auto",
                        frames=1800,
                        share=1.0,
                        preprocess="cpu",
                        preprocess_reason="the onnxruntime runner takes host arrays; "
                        "GPU preprocessing feeds TensorRT engines only",
                    )
                ],
                serving="requested",
                runs=RunsInfo(requested="fp32", precision="fp32", source="built"),
            ),
            "aux": SlotInfo(
                state="empty",
                reason="model file /opt/models/aux.onnx not found",
                workers=1,
                layout="configured",
            ),
        },
        streams=["cam0"],
        cameras={
            # Streaming again after it was lost once: the reason of that loss stays until the next one.
            "cam0": CameraInfo(
                state="streaming",
                since=TS - 3600,
                frames=107940,
                reconnects=1,
                last_error="cannot open camera stream rtsp://***@10.0.4.21:554/main: check that the camera "
                "is reachable and the URL, path and credentials are right",
                last_error_at=TS - 3604,
            ),
        },
        # The configuration overlay it runs (docs/configuration-over-the-air.md).
        config=TargetInfo(version="site-north-3", job_id="cfg-0042"),
    ),
    "TelemetryMessage": TelemetryMessage.model_validate(
        {
            "ts": TS,
            "stream.cam0.fps": 29.8,
            "stream.cam0.capture_fps": 30.0,
            "stream.cam0.source.state": 2,
            "stream.cam0.source.reconnects": 0,
            "stream.cam0.source.last_frame_age_s": 0.021,
            "stream.cam0.frames_published": 51234,
            "stream.cam0.dropped.queue_full": 3,
            "stream.cam0.latency.total.p95_ms": 9.9,
            "slot.main.latency.infer.p95_ms": 7.4,
            "slot.main.active": 1,
            "mqtt.connected": 1,
            "mqtt.spool_depth": 0,
            "process.cpu_percent": 31.5,
            "memory.percent": 42.1,
        }
    ),
    "ResultMessage": ResultMessage(
        msg_id="e7a9",
        ts=TS,
        stream="cam0",
        frame_index=1234,
        captured_at=TS - 0.021,
        published_at=TS,
        model=MODEL,
        latency_ms={"preprocess": 1.9, "queue": 0.3, "infer": 7.1, "postprocess": 0.4, "total": 9.7},
        classes=[ClassScore(index=281, label="tabby cat", score=0.91)],
    ),
    "JobStatus": JobStatus(
        msg_id="0a11",
        ts=TS,
        job_id="job-7",
        slot="main",
        state=JobState.DOWNLOADING,
        progress=0.4,
        bytes_done=5_600_000,
        bytes_total=14_000_000,
        timings_s={},
        requested=REQUESTED,
    ),
    "CommandRequest": CommandRequest(msg_id="c0de", ts=TS, args={"slot": "main"}),
    "CommandReply": CommandReply(
        msg_id="r3p1",
        ts=TS,
        command="rollback",
        ok=True,
        result={"slot": "main", "model": MODEL.model_dump(mode="json", exclude_none=True)},
    ),
}


#: Examples after the first under the same heading of docs/protocol.md, in the doc's order.
MORE_EXAMPLES: dict[str, list[BaseModel]] = {
    "JobStatus": [
        JobStatus(
            msg_id="0a12",
            ts=TS + 41,
            job_id="job-7",
            slot="main",
            state=JobState.ACTIVE,
            timings_s={"download": 3.2, "verify": 0.1, "build": 0.5, "validate": 0.2},
            requested=REQUESTED,
            effective=EFFECTIVE,
            runs=runs_of(EFFECTIVE),
        ),
        JobStatus(
            msg_id="0b01",
            ts=TS,
            job_id="job-8",
            slot="main",
            state=JobState.REJECTED,
            timings_s={},
            error_code="wrong_device",
            error="manifest is for device 'jet-02', this is 'jet-01'; publish it on that device's topic",
        ),
    ],
    "CommandReply": [
        CommandReply(
            msg_id="r3p2",
            ts=TS + 5,
            command="rollback",
            ok=False,
            error_code="no_rollback_target",
            error="slot 'main' was already rolled back to mobilenet 3; a rollback goes back one step, never "
            "forward: deploy a model (or change the config's) to move on",
        ),
    ],
}


def _delivery_examples() -> dict[str, BaseModel]:
    # Imported here: the manifest models live in agent.delivery, not agent.protocol.
    from agent.protocol.manifest import DeployManifest, ModelSourceRef, SignedManifest
    from agent.specs.build import BuildSpec
    from agent.specs.postprocess import ClassificationSpec
    from agent.specs.preprocess import PreprocessSpec

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
        probation_s=60.0,  # what `fleet deploy` sends unless --probation-s says otherwise
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
