"""The ONNX Runtime build: the artifact is the model ONNX Runtime will run, written by ORT itself.

- FP32 on CPU: the fully optimized model ONNX Runtime writes (``optimize_model``), so loading it
  later skips graph optimization.
- GPU (CUDA or TensorRT provider): the model as given. A CPU-optimized graph carries CPU-only fused
  operators, so ORT optimizes at load with the GPU providers; with the TensorRT provider the build
  opens one session to fill the provider's engine cache (stored in the cache entry).
- INT8: :func:`agent.engines.calibration.int8.quantize_int8` calibrates on the frames (Entropy) and
  writes a Q/DQ model plus the calibration table; both are cached, and the table is also converted
  to a TensorRT calibration cache (``calibration.trt.cache``) so a calibration done here can feed a
  Jetson build.

:func:`provider_options` (pure) maps a :class:`BuildPlan` onto ONNX Runtime's provider list: the
TensorRT provider with FP16/INT8, DLA core, calibration table, engine/timing cache paths,
optimization level and workspace; then CUDA; then CPU. :func:`build_onnxruntime` runs in the build
child (:mod:`agent.engines.building.worker_child`).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import structlog

from agent.engines.calibration.data import load_batches
from agent.engines.job import MIB, BuildJob, Progress, WorkerResult
from agent.errors import BuildError, EngineError
from agent.specs.build import BuildPlan, ShapeProfile

log = structlog.get_logger(__name__)

TENSORRT_EP = "TensorrtExecutionProvider"
CUDA_EP = "CUDAExecutionProvider"
CPU_EP = "CPUExecutionProvider"

#: File names inside an ONNX Runtime cache entry.
ENGINE_FILE = "model.onnx"
TABLE_FILE = "calibration.json"
TRT_CACHE_FILE = "calibration.trt.cache"
TRT_ENGINE_DIR = "trt_engines"
REPORT_FILE = "report.json"
#: The EP-context model ONNX Runtime's TensorRT provider dumps (loads without an engine build).
EP_CONTEXT_FILE = "model_ctx.onnx"

ProviderOptions = list[tuple[str, dict[str, str]]]


@dataclass(frozen=True)
class OrtPaths:
    """Where ONNX Runtime's TensorRT provider keeps its files for one engine.

    ``calibration_table`` is a file *name* inside ``engine_cache_dir``: the provider looks the
    table up relative to its engine cache path.
    """

    engine_cache_dir: Path
    timing_cache_dir: Path
    calibration_table: str | None = None
    #: Where the build dumps the EP-context model (None: loading, or no dump wanted).
    ep_context_dump: Path | None = None


def ep_context_options(plan: BuildPlan, dump_to: Path | None) -> dict[str, str]:
    """TensorRT provider options that dump an EP-context model to ``dump_to`` (build time only).

    ``embed`` puts the serialized engine inside the context model (one file: the cache entry can
    move); ``file`` writes it beside the context model and refers to it by name. At load time
    (``dump_to`` None) the context model itself is loaded and nothing is dumped.
    """
    if plan.ep_context == "off" or dump_to is None:
        return {}
    return {
        "trt_dump_ep_context_model": "True",
        "trt_ep_context_file_path": str(dump_to),
        "trt_ep_context_embed_mode": "1" if plan.ep_context == "embed" else "0",
    }


def runtime_options(plan: BuildPlan) -> dict[str, str]:
    """TensorRT provider options for the run, where the plan asks for them (else the provider's defaults)."""
    options: dict[str, str] = {}
    if plan.trt_context_memory_sharing:
        options["trt_context_memory_sharing_enable"] = "True"
    if plan.trt_auxiliary_streams is not None:
        options["trt_auxiliary_streams"] = str(plan.trt_auxiliary_streams)
    return options


def _flag(value: bool) -> str:
    # ORT's Python binding parses TensorRT provider booleans from the strings "True"/"False".
    return "True" if value else "False"


def _shapes(profiles: Sequence[ShapeProfile], which: str) -> str:
    return ",".join(
        f"{p.input}:{'x'.join(str(d) for d in getattr(p, which))}"
        for p in sorted(profiles, key=lambda p: p.input)
    )


def tensorrt_provider_options(plan: BuildPlan, paths: OrtPaths) -> dict[str, str]:
    """Options of ONNX Runtime's TensorRT provider for ``plan`` (all values strings, as ORT parses them)."""
    options: dict[str, str] = {
        "trt_fp16_enable": _flag(plan.precision == "fp16" or plan.allow_fp16),
        "trt_int8_enable": _flag(plan.precision == "int8"),
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": str(paths.engine_cache_dir),
        "trt_timing_cache_enable": "True",
        "trt_timing_cache_path": str(paths.timing_cache_dir),
        "trt_builder_optimization_level": str(plan.optimization_level),
        "trt_max_workspace_size": str(plan.workspace_mb * MIB),
    }
    # A calibration table applies only to implicit INT8; a Q/DQ model carries its own scales and
    # must never be combined with a table.
    if plan.precision == "int8" and plan.int8_mode == "calibrator" and paths.calibration_table:
        options["trt_int8_calibration_table_name"] = paths.calibration_table
        options["trt_int8_use_native_calibration_table"] = "True"  # TensorRT's own cache format
    if plan.device == "dla" and plan.dla_core is not None:
        # DLA applies only with FP16 or INT8, which the planner guarantees on DLA.
        options["trt_dla_enable"] = "True"
        options["trt_dla_core"] = str(plan.dla_core)
    options.update(runtime_options(plan))
    options.update(ep_context_options(plan, paths.ep_context_dump))
    if plan.profiles:
        options["trt_profile_min_shapes"] = _shapes(plan.profiles, "min")
        options["trt_profile_opt_shapes"] = _shapes(plan.profiles, "opt")
        options["trt_profile_max_shapes"] = _shapes(plan.profiles, "max")
    return options


def provider_options(
    plan: BuildPlan, paths: OrtPaths, available: Sequence[str] | None = None
) -> ProviderOptions:
    """ONNX Runtime providers for ``plan``, best first, with their options; CPU is always last.

    ``available`` (``onnxruntime.get_available_providers()``) drops providers this ORT build lacks;
    None keeps them all. A CPU plan gets the CPU provider only.
    """
    wanted: ProviderOptions = []
    if plan.device != "cpu":
        wanted.append((TENSORRT_EP, tensorrt_provider_options(plan, paths)))
        wanted.append((CUDA_EP, {"device_id": "0"}))
    wanted.append((CPU_EP, {}))
    if available is None:
        return wanted
    return [(name, options) for name, options in wanted if name in available or name == CPU_EP]


def provider_names(providers: ProviderOptions) -> list[str]:
    return [name for name, _ in providers]


# --------------------------------------------------------------------------- child side


def _session_providers(model: Path, providers: ProviderOptions) -> list[str]:
    """Open one session (verifies the artifact loads; fills the TensorRT provider's engine cache)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    try:
        session = ort.InferenceSession(
            str(model),
            sess_options=so,
            providers=provider_names(providers),
            provider_options=[options for _, options in providers],
        )
    except Exception as exc:
        raise BuildError(f"ONNX Runtime cannot load the built model {model.name}: {exc}") from exc
    return list(session.get_providers())


def build_onnxruntime(job: BuildJob, say: Progress) -> WorkerResult:
    """Build the ONNX Runtime artifact of ``job`` into ``job.out_dir`` (runs in the build child)."""
    from agent.backends.onnxruntime import optimize_model

    started = time.monotonic()
    plan = job.plan
    out = job.out_dir
    out.mkdir(parents=True, exist_ok=True)
    trt_engines = out / TRT_ENGINE_DIR
    paths = OrtPaths(
        engine_cache_dir=trt_engines,
        timing_cache_dir=job.timing_cache.parent if job.timing_cache is not None else out / "timing",
        ep_context_dump=out / EP_CONTEXT_FILE,
    )
    providers = provider_options(plan, paths, job.available_providers)
    names = provider_names(providers)
    files: list[str] = []
    extra: dict[str, str | int | float | bool | None] = {"providers": ",".join(names)}
    report: dict[str, Any] = {"providers_requested": names}

    source = job.model
    if plan.precision == "int8" and plan.int8_mode == "qdq" and job.calibration_dir is not None:
        from agent.engines.calibration.int8 import calibration_table_to_trt, quantize_int8

        # The TensorRT provider accepts only symmetric Q/DQ; the CPU kernels prefer asymmetric UINT8.
        target: Literal["cpu", "tensorrt"] = "tensorrt" if TENSORRT_EP in names else "cpu"
        say(f"calibrating (entropy) and quantizing to INT8 Q/DQ for {target}")
        result = quantize_int8(job.model, out / "int8", load_batches(job.calibration_dir, say), target=target)
        source = result.model_path
        shutil.copyfile(result.table_path, out / TABLE_FILE)
        (out / TRT_CACHE_FILE).write_bytes(calibration_table_to_trt(result, job.trt_cache_version))
        files += [TABLE_FILE, TRT_CACHE_FILE]
        extra.update(
            calibration_method=result.method,
            calibrated_tensors=len(result.ranges),
            trt_cache_version=job.trt_cache_version,
            calibration="frames",
        )
        report["calibration"] = {
            "method": result.method,
            "tensors": len(result.ranges),
            "source": "frames",
            "table": TABLE_FILE,
            "trt_cache": TRT_CACHE_FILE,
            "trt_cache_version": job.trt_cache_version,
        }
    elif plan.precision == "int8" and plan.int8_mode == "qdq" and job.calibration_table is not None:
        from agent.engines.calibration.int8 import calibration_table_to_trt, quantize_with_ranges
        from agent.model_contract.calibration_file import read_ranges

        target_given: Literal["cpu", "tensorrt"] = "tensorrt" if TENSORRT_EP in names else "cpu"
        ranges, method = read_ranges(job.calibration_table)
        say(f"quantizing to INT8 Q/DQ for {target_given} with the given calibration: no calibration run")
        result = quantize_with_ranges(job.model, out / "int8", ranges, method=method, target=target_given)
        source = result.model_path
        shutil.copyfile(result.table_path, out / TABLE_FILE)
        (out / TRT_CACHE_FILE).write_bytes(calibration_table_to_trt(result, job.trt_cache_version))
        files += [TABLE_FILE, TRT_CACHE_FILE]
        extra.update(
            calibration_method=result.method, calibrated_tensors=len(result.ranges), calibration="given"
        )
        report["calibration"] = {
            "method": result.method,
            "tensors": len(result.ranges),
            "source": "given",
            "table": TABLE_FILE,
            "trt_cache": TRT_CACHE_FILE,
        }
    elif plan.precision == "int8" and plan.int8_mode == "qdq":
        say("the model carries Q/DQ scales: no calibration")
    elif plan.precision == "int8":
        raise BuildError(
            "ONNX Runtime INT8 needs calibration frames (a stream or a dataset), a calibration cache "
            "or table, or a Q/DQ model"
        )

    engine = out / job.engine_file
    if plan.device == "cpu":
        say("optimizing the graph for the CPU")
        try:
            optimize_model(source, engine, (CPU_EP,))
        except EngineError as exc:
            raise BuildError(str(exc)) from exc
    else:
        shutil.copyfile(source, engine)
    if TENSORRT_EP in names:
        trt_engines.mkdir(parents=True, exist_ok=True)
        if job.timing_cache is not None:
            job.timing_cache.parent.mkdir(parents=True, exist_ok=True)
        say("building the TensorRT provider's engine")
    effective = _session_providers(engine, providers)
    if TENSORRT_EP in names:
        files.append(TRT_ENGINE_DIR)
        if (out / EP_CONTEXT_FILE).is_file():
            # Cached like an engine: the artifact loads it instead of the model, skipping the build.
            files.append(EP_CONTEXT_FILE)
            report["ep_context"] = {"file": EP_CONTEXT_FILE, "mode": plan.ep_context}
    shutil.rmtree(out / "int8", ignore_errors=True)
    extra["providers"] = ",".join(effective)
    report["providers"] = effective
    say(f"built for {', '.join(effective)}")
    return WorkerResult(
        engine_file=job.engine_file,
        files=tuple(files),
        extra=extra,
        report=report,
        build_seconds=time.monotonic() - started,
    )
