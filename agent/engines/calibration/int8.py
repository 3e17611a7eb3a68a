"""INT8 with ONNX Runtime on CPU: calibrate on frames, then quantize statically to a Q/DQ model.

Two steps, each usable alone:

1. :func:`calibrate` runs ONNX Runtime's calibrator (Entropy by default, MinMax on request) over
   preprocessed batches and returns the range ``(min, max)`` of every float tensor. This works on
   any machine, CPU included; the ranges are portable.
2. :func:`quantize_with_ranges` hands those ranges to ``quantize_static``, which writes a Q/DQ model
   (``QuantFormat.QDQ``, per-channel INT8 weights) that ONNX Runtime runs with INT8 kernels on CPU.

:func:`quantize_int8` does both and writes ``model.int8.onnx`` and the calibration table
``calibration.json`` (:mod:`agent.model_contract.calibration_table`). The same ranges become a
TensorRT calibration cache with :func:`calibration_table_to_trt`, so a table computed here can
feed a Jetson build.

``onnxruntime.quantization`` is imported lazily, inside the functions (it pulls in onnx and the
quantizer registry), like every framework import under ``agent/engines``.
"""

from __future__ import annotations

import platform as host_platform
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import onnx
import structlog

from agent.errors import BuildError
from agent.fsutil import atomic_write_bytes
from agent.model_contract.calibration_table import (
    TRT_ALGORITHMS,
    Method,
    check_method,
    finite_range,
    write_table,
)
from agent.model_contract.trt_cache import from_ort_ranges, write_trt_cache

log = structlog.get_logger(__name__)

#: ``cpu``: asymmetric UINT8 activations (what ORT's x86/ARM kernels prefer). ``tensorrt``:
#: symmetric INT8 activations and weights, the only Q/DQ form TensorRT accepts.
Target = Literal["cpu", "tensorrt"]

MODEL_FILE = "model.int8.onnx"
TABLE_FILE = "calibration.json"


#: Highest IR version written: ONNX Runtime 1.31 refuses IR 14, which onnx >= 1.20 writes by
#: default; older Jetson builds of ORT accept less. A model never gets a higher IR than its source's.
MAX_IR_VERSION = 10


#: x86 instruction sets with an INT8 dot product that accumulates without saturating.
_VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def reduce_range_for(target: Target, machine: str, cpu_flags: frozenset[str]) -> bool:
    """Quantize weights to 7 bits: only for ORT's CPU kernels on an x86 CPU without VNNI (pure).

    Without VNNI, ORT's x86 INT8 kernels multiply-add pairs of 8-bit values into 16 bits
    (``vpmaddubsw``), which saturates on full-range weights. Measured on this project's AVX2 build
    machine (AMD EPYC, no VNNI), shapes model, 1,000 held-out images: FP32 top-1 98.9 %; 8-bit weights
    96.7 % (asymmetric) and 52 % (symmetric); 7-bit weights 99.0 %. A TensorRT-target model is never
    reduced: TensorRT accumulates in 32 bits and would only lose a bit of weight precision.
    """
    if target != "cpu" or machine.lower() not in {"x86_64", "amd64", "i686", "i386"}:
        return False
    return not (_VNNI_FLAGS & cpu_flags)


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The ``flags`` of the first processor in a ``/proc/cpuinfo`` text (empty when absent)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def host_cpu_flags() -> frozenset[str]:
    try:
        return parse_cpu_flags(Path("/proc/cpuinfo").read_text(errors="replace"))
    except OSError:
        return frozenset()


@dataclass(frozen=True)
class Int8Result:
    """A quantized model and the calibration table it was quantized with."""

    model_path: Path
    table_path: Path
    ranges: dict[str, tuple[float, float]]
    method: str


def quantize_int8(
    model: Path,
    out_dir: Path,
    batches: Iterable[npt.NDArray[Any]],
    *,
    method: Method = "entropy",
    target: Target = "cpu",
) -> Int8Result:
    """Calibrate ``model`` on ``batches`` and write ``out_dir/model.int8.onnx`` + ``calibration.json``.

    ``batches`` are preprocessed input tensors with a leading batch axis (what the slot feeds the
    model), for the model's first input. BuildError, saying what to do, on any failure.
    """
    ranges = calibrate(model, batches, method=method)
    return quantize_with_ranges(model, out_dir, ranges, method=method, target=target)


def calibrate(
    model: Path, batches: Iterable[npt.NDArray[Any]], *, method: Method = "entropy"
) -> dict[str, tuple[float, float]]:
    """Run ONNX Runtime's ``method`` calibrator over ``batches``; return ``{tensor: (min, max)}``.

    Each batch is collected on its own, so memory holds one batch of activations at a time (ORT's
    calibrators keep every intermediate output of a ``collect_data`` call until it returns).
    """
    from onnxruntime.quantization import CalibrationMethod, create_calibrator

    model = Path(model)
    check_method(method)
    source = _load(model)
    input_name, input_dtype, fixed_batch = _first_input(source)
    calibration_method = CalibrationMethod.Entropy if method == "entropy" else CalibrationMethod.MinMax
    batches_seen = 0
    samples = 0
    with tempfile.TemporaryDirectory(prefix="int8-calib-") as tmp:
        try:
            calibrator = create_calibrator(
                linked_beside(model, source, Path(tmp)),
                [],
                augmented_model_path=str(Path(tmp) / "augmented.onnx"),
                calibrate_method=calibration_method,
            )
        except Exception as exc:
            raise BuildError(f"cannot prepare INT8 calibration of {model.name}: {exc}") from exc
        for batch in batches:
            for chunk in _chunks(_as_input(batch, input_name, input_dtype, source), fixed_batch):
                try:
                    calibrator.collect_data(_OneBatch({input_name: chunk}))
                except Exception as exc:
                    raise BuildError(
                        f"INT8 calibration of {model.name} failed on batch {batches_seen + 1}: {exc}"
                    ) from exc
                samples += len(chunk)
            batches_seen += 1
        if samples == 0:
            raise BuildError(
                f"INT8 calibration of {model.name} got no frames: give a calibration stream, dataset "
                "or cache with at least one frame, or build FP16/FP32"
            )
        try:
            tensors = calibrator.compute_data()
        except Exception as exc:
            raise BuildError(f"INT8 calibration of {model.name} failed computing ranges: {exc}") from exc
    ranges = {name: finite_range(name, data.range_value) for name, data in tensors.items()}
    log.info("engine.int8.calibrated", model=model.name, method=method, samples=samples, tensors=len(ranges))
    return ranges


def quantize_with_ranges(
    model: Path,
    out_dir: Path,
    ranges: Mapping[str, tuple[float, float]],
    *,
    method: Method = "entropy",
    target: Target = "cpu",
) -> Int8Result:
    """Quantize ``model`` statically with known ``ranges`` (no calibration run) into ``out_dir``.

    Writes the Q/DQ model and the calibration table atomically. Used directly when a stored
    calibration table is reused (:mod:`agent.engines.calibration.store`).
    """
    import onnxruntime
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        TensorData,
        TensorsData,
        quantize_static,
        save_tensors_data,
    )

    model, out_dir = Path(model), Path(out_dir)
    check_method(method)
    if not ranges:
        raise BuildError(f"no calibration ranges to quantize {model.name} with: recalibrate")
    clean = {name: finite_range(name, r) for name, r in ranges.items()}
    source = _load(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    calibration_method = CalibrationMethod.Entropy if method == "entropy" else CalibrationMethod.MinMax
    tensors = TensorsData(
        calibration_method,
        {n: TensorData(lowest=np.float32(lo), highest=np.float32(hi)) for n, (lo, hi) in clean.items()},
    )
    symmetric = target == "tensorrt"
    with tempfile.TemporaryDirectory(prefix="int8-quant-", dir=out_dir) as tmp:
        # quantize_static takes precomputed ranges only through its JSON cache file (ORT >= 1.2x);
        # this is ORT's own format, kept in the temporary directory: ours is calibration.json.
        ort_cache = Path(tmp) / "ort-ranges.json"
        save_tensors_data(tensors, ort_cache)
        quantized = Path(tmp) / MODEL_FILE
        try:
            quantize_static(
                str(linked_beside(model, source, Path(tmp))),
                str(quantized),
                calibration_data_reader=None,
                quant_format=QuantFormat.QDQ,
                per_channel=True,
                activation_type=QuantType.QInt8 if symmetric else QuantType.QUInt8,
                weight_type=QuantType.QInt8,
                calibrate_method=calibration_method,
                calibration_cache_path=str(ort_cache),
                reduce_range=reduce_range_for(target, host_platform.machine(), host_cpu_flags()),
                extra_options={"ActivationSymmetric": symmetric, "WeightSymmetric": True},
            )
        except TypeError as exc:
            raise BuildError(
                f"onnxruntime {onnxruntime.__version__} cannot quantize from stored ranges ({exc}): "
                "install an onnxruntime whose quantize_static has calibration_cache_path (1.31 does)"
            ) from exc
        except Exception as exc:
            raise BuildError(f"INT8 quantization of {model.name} failed: {exc}") from exc
        result_model = onnx.load(str(quantized))
    _pin_ir_version(result_model, source.ir_version)
    model_path = out_dir / MODEL_FILE
    table_path = out_dir / TABLE_FILE
    atomic_write_bytes(model_path, result_model.SerializeToString())
    write_table(table_path, clean, method=method)
    log.info("engine.int8.quantized", model=model.name, method=method, target=target, out=str(model_path))
    return Int8Result(model_path=model_path, table_path=table_path, ranges=clean, method=method)


def calibration_table_to_trt(result: Int8Result, trt_version: str) -> bytes:
    """The result's ranges as a TensorRT calibration cache for ``trt_version`` (e.g. ``'10.3.0'``).

    Scales are ``max(|min|, |max|) / 127`` per tensor (TensorRT is symmetric); the header names
    the TensorRT algorithm matching the ONNX Runtime method.
    """
    check_method(result.method)
    return write_trt_cache(from_ort_ranges(result.ranges), trt_version, TRT_ALGORITHMS[result.method])


class _OneBatch:
    """ONNX Runtime ``CalibrationDataReader``: yields one feed dict, then None."""

    def __init__(self, feeds: dict[str, npt.NDArray[Any]]) -> None:
        self._feeds: dict[str, npt.NDArray[Any]] | None = feeds

    def get_next(self) -> dict[str, npt.NDArray[Any]] | None:
        feeds, self._feeds = self._feeds, None
        return feeds


def linked_beside(model: Path, source: onnx.ModelProto, directory: Path) -> Path:
    """``model`` as a link in ``directory``, with links to its external data files.

    ONNX Runtime's calibrator and ``quantize_static`` write ``<model>-inferred.onnx`` beside the
    model they are given and delete it after: beside a read-only model that fails, and two builds of
    one model (two slots, two test workers) remove each other's file half-read. Through a link in
    the build's own temporary directory each writes its own; external data resolves beside the link,
    so its files are copied there (ONNX refuses them behind a symbolic or a hard link).
    """
    directory = directory / "source"  # apart from what the build writes in the same directory
    directory.mkdir()
    link = directory / model.name
    link.symlink_to(model.resolve())
    locations = {
        entry.value
        for tensor in source.graph.initializer
        for entry in tensor.external_data
        if entry.key == "location"
    }
    for location in locations:
        if Path(location).is_absolute() or ".." in Path(location).parts:
            continue  # ONNX refuses such a location itself, naming it
        target = directory / location
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            # ONNX refuses external data behind a symbolic or a hard link: a copy.
            shutil.copyfile(model.parent / location, target)
    return link


def _load(model: Path) -> onnx.ModelProto:
    if not model.is_file():
        raise BuildError(f"model {model} does not exist: deploy it again before building INT8")
    try:
        return onnx.load(str(model), load_external_data=False)
    except Exception as exc:
        raise BuildError(f"model {model} is not a readable ONNX file ({exc}): deploy it again") from exc


def _first_input(model: onnx.ModelProto) -> tuple[str, np.dtype[Any], int | None]:
    """Name, numpy dtype and fixed batch size (None when dynamic) of the model's first real input."""
    initializers = {init.name for init in model.graph.initializer}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor_type = value.type.tensor_type
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type))
        dims = tensor_type.shape.dim
        fixed = (
            dims[0].dim_value if dims and dims[0].HasField("dim_value") and dims[0].dim_value > 0 else None
        )
        return value.name, dtype, fixed
    raise BuildError("the model has no inputs to calibrate: check the ONNX file")


def _as_input(
    batch: npt.NDArray[Any], name: str, dtype: np.dtype[Any], model: onnx.ModelProto
) -> npt.NDArray[Any]:
    array = np.asarray(batch)
    expected_rank = len(next(v for v in model.graph.input if v.name == name).type.tensor_type.shape.dim)
    if array.ndim != expected_rank:
        raise BuildError(
            f"calibration batch for input {name!r} has shape {array.shape}; the model expects "
            f"{expected_rank} dimensions with the batch first: preprocess frames as the slot does"
        )
    return np.ascontiguousarray(array, dtype=dtype)


def _chunks(array: npt.NDArray[Any], fixed_batch: int | None) -> Iterator[npt.NDArray[Any]]:
    """Split a batch into the model's fixed batch size (a dynamic batch axis takes it whole)."""
    if fixed_batch is None:
        if len(array):
            yield array
        return
    usable = len(array) - len(array) % fixed_batch
    if usable != len(array):
        log.warning("engine.int8.calibration_frames_dropped", dropped=len(array) - usable, batch=fixed_batch)
    for start in range(0, usable, fixed_batch):
        yield array[start : start + fixed_batch]


def _pin_ir_version(model: onnx.ModelProto, source_ir: int) -> None:
    """Lower the IR version to what ONNX Runtime loads, never below what the opsets require."""
    needed = onnx.helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    model.ir_version = max(min(model.ir_version, source_ir, MAX_IR_VERSION), needed)
