"""Lay out one build's inputs for the child: the :class:`BuildJob` of a plan, with its files.

:class:`~agent.engines.building.builder.EngineBuilder` calls :func:`job_for` under its build lock, after a
cache miss. The job names every path the child reads or writes, absolute, so the child does not
depend on the working directory:

- a calibration ``cache`` source becomes a TensorRT calibration cache (for a TensorRT build) or the
  calibration table ONNX Runtime quantizes with (every device then uses the operator's ranges);
- ``dataset`` and ``stream`` frames are written as batch files in the job directory; a TensorRT
  calibrator build also gets the cache path it writes after calibrating, keyed by model and frames,
  so the next build with the same model and frames skips calibration;
- the TensorRT timing cache is one file per GPU, compute capability and TensorRT version.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy.typing as npt

from agent.engines.building.ort import ENGINE_FILE as ORT_ENGINE_FILE
from agent.engines.cache.key import canonical_json, model_sha256
from agent.engines.calibration.data import dataset_batches, limit_frames, save_batches
from agent.engines.job import BuildJob
from agent.errors import BuildError
from agent.fsutil import atomic_write_bytes, sha256_file
from agent.machine.platform import Platform
from agent.model_contract.calibration_file import as_trt_cache
from agent.model_contract.model_facts import model_input_size
from agent.specs.build import BuildPlan
from agent.specs.preprocess import PreprocessSpec

#: Engine file name of a TensorRT entry.
TRT_ENGINE_FILE = "engine"
#: TensorRT version whose header a CPU-made calibration cache gets when no TensorRT is present:
#: JetPack 6.1/6.2, the main target.
DEFAULT_TRT_CACHE_VERSION = "10.3.0"


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "unknown"


def default_preprocess(model: Path) -> PreprocessSpec:
    """The preprocessing a ``dataset`` calibration uses when the caller gives none: the model's
    input size, RGB, pixels / 255. Raises :class:`BuildError` when the input has no fixed size."""
    size = model_input_size(model)
    if size is None:
        raise BuildError(
            f"cannot calibrate {model.name} from a dataset: its input has no fixed NCHW image size; "
            "pass the slot's preprocessing (or --width/--height to edge-agent build)"
        )
    return PreprocessSpec(width=size[0], height=size[1])


def timing_cache_path(state_dir: Path, platform: Platform) -> Path:
    """The TensorRT timing cache of this GPU, compute capability and TensorRT version."""
    p = platform
    gpu = _safe(p.gpu_name or "gpu")
    name = f"{gpu}-sm{_safe(p.compute_capability or 'x')}-trt{_safe(p.tensorrt_version or 'x')}"
    return state_dir / "timing" / f"{name}.cache"


def job_for(
    model: Path,
    plan: BuildPlan,
    job_dir: Path,
    calibration: Iterable[npt.NDArray[Any]] | None,
    preprocess: PreprocessSpec | None,
    *,
    state_dir: Path,
    platform: Platform,
) -> BuildJob:
    """The job that builds ``plan`` from ``model`` in ``job_dir``, its calibration files written.

    ``state_dir`` holds the per-device calibration and timing caches. Raises :class:`BuildError`
    when the calibration source gives nothing to calibrate with.
    """
    calibration_dir: Path | None = None
    calibration_cache: Path | None = None
    calibration_table: Path | None = None
    source = plan.calibration
    if source is not None:
        if source.kind == "cache":
            if source.path is None:
                raise BuildError(
                    f"calibration artifact {source.artifact!r} was not fetched: only a deployment "
                    "carries artifacts; give the cache file's path"
                )
            if plan.backend != "tensorrt":
                # The operator's calibration: every device quantizes with the same ranges.
                calibration_table = job_dir / "calibration.table"
                calibration_table.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source.path, calibration_table)
            else:
                calibration_cache = state_dir / "calibration" / f"{sha256_file(source.path)}.cache"
                calibration_cache.parent.mkdir(parents=True, exist_ok=True)
                assert platform.tensorrt_version is not None
                atomic_write_bytes(calibration_cache, as_trt_cache(source.path, platform.tensorrt_version))
        else:
            batches = calibration
            if batches is None and source.kind == "dataset":
                assert source.path is not None
                assert preprocess is not None
                batches = dataset_batches(source.path, preprocess, source.frames)
            if batches is None:
                raise BuildError(
                    f"INT8 calibration from stream {source.stream!r} needs frames: the caller must pass them"
                )
            calibration_dir = job_dir / "calibration"
            count, data_sha = save_batches(limit_frames(batches, source.frames), calibration_dir)
            if count == 0:
                raise BuildError("INT8 calibration got no frames: check the calibration source")
            if plan.backend == "tensorrt" and plan.int8_mode == "calibrator":
                # TensorRT writes its cache here after calibrating; the next build with the same
                # model and frames skips calibration.
                assert platform.tensorrt_version is not None
                calib_key = hashlib.sha256(
                    canonical_json([sha256_file(model), platform.tensorrt_version, data_sha])
                ).hexdigest()
                calibration_cache = state_dir / "calibration" / f"{calib_key}.cache"
    return BuildJob(
        kind=plan.backend,
        model=model.resolve(),
        out_dir=(job_dir / "out").resolve(),
        plan=plan,
        engine_file=TRT_ENGINE_FILE if plan.backend == "tensorrt" else ORT_ENGINE_FILE,
        calibration_dir=calibration_dir.resolve() if calibration_dir is not None else None,
        calibration_cache=calibration_cache,
        calibration_table=calibration_table.resolve() if calibration_table is not None else None,
        timing_cache=timing_cache_path(state_dir, platform)
        if plan.backend == "tensorrt"
        else state_dir / "timing" / "ort",
        trt_cache_version=platform.tensorrt_version or DEFAULT_TRT_CACHE_VERSION,
        model_sha256=model_sha256(model),
        slim_cache_dir=state_dir / "slim",
        available_providers=platform.ort_providers or ("CPUExecutionProvider",),
    )
