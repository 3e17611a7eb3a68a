"""A manifest's extra files (an INT8 calibration): fetched like the model, kept beside it, bounded.

Each artifact is pulled through the same fetch path as the model (:meth:`DeployManifest.for_artifact`:
the chunk server answers by SHA-256; an ``http`` url first when given), every chunk verified against
the signed manifest, the whole file hashed again when it is adopted. They are kept content-addressed
under ``<state_dir>/artifacts/``, at most :data:`KEEP` of them (least recently used go first, never
one an active or last-known-good engine was built with): a second job with the same calibration
fetches nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from pathlib import Path

from agent.delivery.jobs.steps import FetchFn
from agent.protocol.delivery_errors import HashMismatchError, TooLargeError
from agent.protocol.manifest import DeployManifest
from agent.specs.build import BuildSpec
from agent.store import ModelStore

#: Artifacts kept on the device (each is a few kilobytes to a few megabytes).
KEEP = 16


def _quiet(done: int, total: int) -> None:
    # The job's progress is the model's download; artifacts are small and follow it.
    del done, total


def fetch_artifacts(
    manifest: DeployManifest,
    store: ModelStore,
    *,
    fetch: FetchFn,
    part_dir: Path,
    cancel: threading.Event,
    max_bytes: int,
    protect: Collection[str] = (),
    held: Collection[str] = (),
) -> dict[str, Path]:
    """Every artifact of ``manifest`` on disk, verified: ``{name: path}``, except those whose SHA-256 is
    in ``held`` (a device target keeps them itself: the wheels an agent release shares with the last).

    ``protect``: SHA-256s the cleanup keeps besides this job's artifacts: the calibrations the
    slots' active and last-known-good engines were built with (a rollback may rebuild from one).

    Raises TooLargeError for an artifact over ``max_bytes`` (before fetching anything), or whatever
    the fetch raises (HashMismatchError, TransferTimeoutError, ...).
    """
    artifacts = manifest.artifacts or []
    for artifact in artifacts:
        if artifact.size > max_bytes:
            raise TooLargeError(
                f"artifact {artifact.name!r} announces {artifact.size} bytes, more than "
                f"delivery.max_model_bytes={max_bytes}",
                job_id=manifest.job_id,
            )
    paths: dict[str, Path] = {}
    for artifact in artifacts:
        if artifact.sha256 in held:
            continue
        if store.has(artifact.sha256):
            store.touch(artifact.sha256)
            paths[artifact.name] = store.path_for(artifact.sha256)
            continue
        part_dir.mkdir(parents=True, exist_ok=True)
        fetched = fetch(manifest.for_artifact(artifact), part_dir, _quiet, cancel)
        try:
            paths[artifact.name] = store.adopt(fetched, artifact.sha256)
        except HashMismatchError as exc:
            raise HashMismatchError(
                f"artifact {artifact.name!r}: the fetched file does not hash to the signed {artifact.sha256} "
                "and was discarded",
                job_id=manifest.job_id,
            ) from exc
    store.gc(protect={a.sha256 for a in artifacts} | set(protect), keep=KEEP)
    return paths


def with_artifacts(build: BuildSpec | None, paths: dict[str, Path]) -> BuildSpec | None:
    """``build`` with its calibration artifact replaced by the fetched file's path."""
    calibration = build.calibration if build is not None else None
    if build is None or calibration is None or calibration.artifact is None:
        return build
    resolved = calibration.model_copy(update={"path": paths[calibration.artifact], "artifact": None})
    return build.model_copy(update={"calibration": resolved})
