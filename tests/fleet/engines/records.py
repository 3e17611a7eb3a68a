"""Engine offers and records for the controller-side tests (no engine is built: the store keeps bytes)."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from agent.fleet.engines.desk import EngineDesk
from agent.protocol.engines import EngineFile, EngineOffer, EngineRecord

KEY = "a" * 64


def engine_file(name: str, data: bytes) -> EngineFile:
    return EngineFile(
        name=name,
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        chunk_size=4096,
        chunks=[hashlib.sha256(data[i : i + 4096]).hexdigest() for i in range(0, len(data), 4096)],
    )


def offer(key: str = KEY, data: bytes = b"engine bytes", **changes: object) -> EngineOffer:
    fields: dict[str, object] = {
        "key": key,
        "fingerprint": "onnxruntime 1.20 / x86_64 / cpu",
        "meta": {"engine_file": "model.onnx", "engine_sha256": hashlib.sha256(data).hexdigest()},
        "files": [engine_file("model.onnx", data)],
        "built_at": time.time(),
        "build_seconds": 3.0,
        "job_id": "job-1",
        "shadow": True,
        "probation_s": 2.0,
    }
    fields.update(changes)
    return EngineOffer.model_validate(fields)


def store_engine(desk: EngineDesk, device: str, data: bytes, **changes: object) -> EngineOffer:
    """An engine offered by ``device`` as a device offers it (offer, upload the file, offer again) and
    stored by ``desk``; its key is the data's SHA-256 unless ``changes`` name one."""
    made = offer(**{"key": hashlib.sha256(data).hexdigest(), "data": data, **changes})  # type: ignore[arg-type]
    desk.handle(device, "offer", made.model_dump_json().encode(), {})
    properties = {"sha256": made.files[0].sha256, "offset": "0", "size": str(len(data))}
    desk.handle(device, "piece", data, properties)
    assert desk.handle(device, "offer", made.model_dump_json().encode(), {}) == {"stored": True}
    return made


def record_of(made: EngineOffer, built_by: str = "dev-a") -> EngineRecord:
    return EngineRecord(
        key=made.key,
        fingerprint=made.fingerprint,
        meta=made.meta,
        files=made.files,
        built_by=built_by,
        built_at=made.built_at,
        build_seconds=made.build_seconds,
        job_id=made.job_id,
        vouched_at=time.time(),
    )


def put_blob(blobs: Path, data: bytes) -> None:
    (blobs / f"{hashlib.sha256(data).hexdigest()}.onnx").write_bytes(data)
