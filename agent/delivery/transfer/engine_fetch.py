"""A fleet-shared engine's files, pulled like a model: the same chunked MQTT pull and checks.

The controller vouches for each file of a shared engine with its size, SHA-256 and per-chunk
hashes (:class:`~agent.protocol.engines.EngineFile`, inside the signed record); this describes it
as a manifest for the delivery fetch, so every chunk is checked as it arrives and the whole file
once it is complete, as a model's are. The controller's chunk server answers by SHA-256.
"""

from __future__ import annotations

import threading
from pathlib import Path

from agent.delivery.jobs.steps import FetchFn
from agent.fsutil import sha256_file
from agent.protocol.delivery_errors import HashMismatchError
from agent.protocol.engines import EngineFile
from agent.protocol.manifest import DeployManifest, ModelSourceRef


def _quiet(done: int, total: int) -> None:
    del done, total  # the job's progress is the build step's; an engine download reports its end


def engine_file_manifest(file: EngineFile) -> DeployManifest:
    """``file`` described as a deploy manifest (for the fetch path only: never published or run)."""
    return DeployManifest(
        job_id=f"engine-{file.sha256[:16]}",
        sequence=1,
        slot="engine",
        model_id="engine",
        version=file.sha256[:12],
        size=file.size,
        sha256=file.sha256,
        chunk_size=file.chunk_size,
        chunks=list(file.chunks),
        sources=[ModelSourceRef(kind="mqtt")],
    )


def fetch_engine_file(
    file: EngineFile, directory: Path, cancel: threading.Event | None, *, fetch: FetchFn
) -> Path:
    """``file`` pulled into ``directory`` and checked whole against its signed SHA-256."""
    path = fetch(engine_file_manifest(file), directory, _quiet, cancel or threading.Event())
    actual = sha256_file(path)
    if actual != file.sha256:
        path.unlink(missing_ok=True)
        raise HashMismatchError(
            f"engine file {file.name!r} hashes to {actual[:12]}, not the signed {file.sha256[:12]}; discarded"
        )
    return path
