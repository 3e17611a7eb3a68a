"""An operator's calibration file, whichever of the two formats it is, as ranges or a TensorRT cache.

A calibration shipped with a deployment (``calibration: {kind: cache, artifact: ...}``) is either

- a calibration table (:func:`agent.model_contract.calibration_table.write_table`, JSON ``{"format":
  "edge-agent.calibration-table", "ranges": {tensor: [min, max]}}``): what an ONNX Runtime INT8
  build writes as ``calibration.json`` and quantizes with; or
- a TensorRT calibration cache (``TRT-<tag>-<algorithm>`` text): what a TensorRT build writes.

An ONNX Runtime build quantizes with ranges (:func:`read_ranges`; a TensorRT cache's scales become
the symmetric ranges ``±scale*127``); a TensorRT build consumes a cache (:func:`as_trt_cache`; a
table is converted for the running TensorRT version). Either way every device quantizes with the
same numbers, so they build the same engine without calibrating on their own frames.
"""

from __future__ import annotations

from pathlib import Path

from agent.errors import BuildError
from agent.model_contract.calibration_table import TABLE_FORMAT, TRT_ALGORITHMS, Method, read_table
from agent.model_contract.trt_cache import INT8_MAX, from_ort_ranges, read_trt_cache, write_trt_cache

#: TensorRT's algorithm name -> the ONNX Runtime method that computes the same kind of range.
_METHOD_OF_ALGORITHM: dict[str, Method] = {
    "EntropyCalibration2": "entropy",
    "EntropyCalibration": "entropy",
    "MinMaxCalibration": "minmax",
    "LegacyCalibration": "entropy",
}


def _is_table(data: bytes) -> bool:
    return data.lstrip()[:1] == b"{" and TABLE_FORMAT.encode() in data[:4096]


def read_ranges(path: Path) -> tuple[dict[str, tuple[float, float]], Method]:
    """``{tensor: (min, max)}`` and the method of a calibration table or TensorRT cache.

    BuildError naming the file when it is neither.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BuildError(f"calibration file {path} is unreadable: {exc}") from exc
    if _is_table(data):
        return read_table(path)
    try:
        cache = read_trt_cache(data)
    except BuildError as exc:
        raise BuildError(
            f"calibration file {path.name} is neither an edge-agent calibration table nor a TensorRT "
            f"calibration cache ({exc})"
        ) from exc
    if not cache.scales:
        raise BuildError(f"TensorRT calibration cache {path.name} names no tensor")
    ranges = {name: (-scale * INT8_MAX, scale * INT8_MAX) for name, scale in cache.scales.items()}
    return ranges, _METHOD_OF_ALGORITHM.get(cache.algorithm, "entropy")


def as_trt_cache(path: Path, trt_version: str) -> bytes:
    """The file as a TensorRT calibration cache: as is when it is one, converted when it is a table."""
    data = Path(path).read_bytes()
    if not _is_table(data):
        return data
    ranges, method = read_table(Path(path))
    return write_trt_cache(from_ort_ranges(ranges), trt_version, TRT_ALGORITHMS[method])
