"""The TensorRT build in the build child: a :class:`BuildJob` in, a serialized engine and its placement out.

:func:`build_engine` composes the named steps of :mod:`agent.engines.trt.steps`
(``NetworkFromOnnxPath`` -> ``CreateConfig`` -> ``EngineBytesFromNetwork`` -> ``PlacementFromBuild``);
:func:`build_tensorrt` prepares the job's INT8 inputs (a Q/DQ model for TensorRT 11, the
calibration cache and batches for the calibrator), runs it, and writes the engine. Every decision
is a pure function in :mod:`agent.engines.trt.decisions`; parsing where the layers run is
:mod:`agent.engines.trt.placement`. Run it in a child process: a TensorRT crash must not take the
agent down.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from agent.backends.trt_api import tensorrt_status
from agent.engines.calibration.data import load_batches
from agent.engines.job import BuildJob, Progress, WorkerResult
from agent.engines.trt.calibrator import CalibrationBatch
from agent.engines.trt.decisions import target_label, warning_lines
from agent.engines.trt.log import BuildLog, capturing_logger
from agent.engines.trt.placement import Placement
from agent.engines.trt.steps import (
    CreateConfig,
    EngineBytesFromNetwork,
    NetworkFromOnnxPath,
    PlacementFromBuild,
)
from agent.errors import BuildError
from agent.specs.build import BuildPlan


@dataclass(frozen=True)
class BuiltEngine:
    """A serialized engine and what the build reported."""

    plan: bytes
    placement: Placement
    build_log: str
    build_seconds: float
    trt_version: str
    warnings: list[str] = field(default_factory=list)


def build_engine(
    onnx_path: Path,
    plan: BuildPlan,
    *,
    timing_cache: Path | None,
    calibration_cache: Path | None,
    calib_batches: Iterable[CalibrationBatch] | None,
    log: Progress | None = None,
) -> BuiltEngine:
    """Build a serialized TensorRT engine from ``onnx_path`` as ``plan`` says.

    ``timing_cache`` is read if it exists and rewritten after the build; ``calibration_cache``
    and ``calib_batches`` feed the INT8 entropy calibrator (``int8_mode == 'calibrator'``): with a
    valid cache TensorRT skips calibration. ``log`` receives progress and error lines. Raises
    :class:`BuildError` with the reason (parser errors, the tail of TensorRT's log, ...).
    """
    say = log if log is not None else (lambda _line: None)
    ok, why = tensorrt_status()
    if not ok:
        raise BuildError(why)
    import tensorrt as trt

    started = time.monotonic()
    build_log = BuildLog(sink=say)
    logger = capturing_logger(build_log)
    engine_bytes = EngineBytesFromNetwork(
        NetworkFromOnnxPath(onnx_path, plan, logger, say),
        CreateConfig(
            plan, timing_cache=timing_cache, calibration_cache=calibration_cache, calib_batches=calib_batches
        ),
        build_log=build_log,
        say=say,
        target=target_label(plan),
        save_timing_cache=timing_cache,
    )()
    placement = PlacementFromBuild(build_log, logger, plan.dla_core if plan.device == "dla" else None)(
        engine_bytes
    )
    seconds = time.monotonic() - started
    say(f"built in {seconds:.1f}s: {placement.dla_layers} DLA / {placement.gpu_layers} GPU layers")
    return BuiltEngine(
        plan=engine_bytes,
        placement=placement,
        build_log=build_log.text(),
        build_seconds=seconds,
        trt_version=trt.__version__,
        warnings=warning_lines(build_log.text()),
    )


def build_tensorrt(job: BuildJob, say: Progress) -> WorkerResult:
    """TensorRT build of ``job`` in the build child: INT8 inputs, :func:`build_engine`, the engine file."""
    model, calib_batches = _int8_inputs(job, say)
    built = build_engine(
        model,
        job.plan,
        timing_cache=job.timing_cache,
        calibration_cache=job.calibration_cache,
        calib_batches=calib_batches,
        log=say,
    )
    (job.out_dir / job.engine_file).write_bytes(built.plan)
    placement = built.placement
    return WorkerResult(
        engine_file=job.engine_file,
        extra={
            "trt_version": built.trt_version,
            "dla_layers": placement.dla_layers,
            "gpu_layers": placement.gpu_layers,
            "placement_source": placement.source,
        },
        report={"placement": placement.as_dict(), "warnings": built.warnings[-20:]},
        build_seconds=built.build_seconds,
    )


def _int8_inputs(job: BuildJob, say: Progress) -> tuple[Path, Iterable[CalibrationBatch] | None]:
    """The model to build (a Q/DQ copy when the plan quantizes first) and the calibrator's batches."""
    if job.plan.int8_mode == "qdq" and job.calibration_dir is not None:
        # TensorRT >= 11 has no calibrators: quantize to Q/DQ with ONNX Runtime's calibrator first.
        from agent.engines.calibration.int8 import quantize_int8

        say("quantizing to Q/DQ for TensorRT")
        batches = load_batches(job.calibration_dir, say)
        return quantize_int8(job.model, job.out_dir / "qdq", batches, target="tensorrt").model_path, None
    if job.plan.int8_mode != "calibrator":
        return job.model, None
    if job.calibration_cache is not None and job.calibration_cache.is_file():
        import tensorrt as trt

        from agent.engines.trt.calibrator import read_cache_bytes
        from agent.model_contract.trt_cache import check_cache_version, read_trt_cache

        # A cache written for another TensorRT is refused here, naming both versions.
        data = read_cache_bytes(job.calibration_cache)
        if data is not None:
            check_cache_version(read_trt_cache(data), trt.__version__)
    return job.model, load_batches(job.calibration_dir, say) if job.calibration_dir is not None else None
