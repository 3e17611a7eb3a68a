"""The calibration table: every tensor's ``(min, max)`` range as JSON, what INT8 builds quantize with."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np

from agent.errors import BuildError
from agent.fsutil import atomic_write_json

Method = Literal["entropy", "minmax"]

TABLE_FORMAT = "edge-agent.calibration-table"
TABLE_VERSION = 1

#: TensorRT's name of each calibration algorithm (the cache header's last field).
TRT_ALGORITHMS: dict[str, str] = {"entropy": "EntropyCalibration2", "minmax": "MinMaxCalibration"}


def check_method(method: str) -> None:
    if method not in TRT_ALGORITHMS:
        raise BuildError(f"calibration method {method!r} is unknown: use 'entropy' or 'minmax'")


def write_table(
    path: Path,
    ranges: Mapping[str, tuple[float, float]],
    *,
    method: str,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Write a calibration table atomically.

    JSON ``{"format", "version", "method", "onnxruntime", "ranges": {tensor: [min, max]}}`` plus
    the ``extra`` fields (the calibration store adds its key).
    """
    import onnxruntime

    check_method(method)
    doc: dict[str, Any] = dict(extra or {})
    doc.update(
        {
            "format": TABLE_FORMAT,
            "version": TABLE_VERSION,
            "method": method,
            "onnxruntime": onnxruntime.__version__,
            "ranges": {name: [float(lo), float(hi)] for name, (lo, hi) in sorted(ranges.items())},
        }
    )
    atomic_write_json(Path(path), doc)


def read_table(path: Path) -> tuple[dict[str, tuple[float, float]], Method]:
    """Read a table written by :func:`write_table`; BuildError naming the problem when it is not one."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise BuildError(f"calibration table {path} is unreadable ({exc}): recalibrate") from exc
    if not isinstance(doc, dict) or doc.get("format") != TABLE_FORMAT:
        raise BuildError(f"{path} is not an edge-agent calibration table: recalibrate")
    if doc.get("version") != TABLE_VERSION:
        raise BuildError(f"calibration table {path} has version {doc.get('version')!r}: recalibrate")
    method = doc.get("method")
    if method not in TRT_ALGORITHMS:
        raise BuildError(f"calibration table {path} has unknown method {method!r}: recalibrate")
    raw = doc.get("ranges")
    if not isinstance(raw, dict) or not raw:
        raise BuildError(f"calibration table {path} has no ranges: recalibrate")
    ranges: dict[str, tuple[float, float]] = {}
    for name, pair in raw.items():
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(v, int | float) for v in pair)):
            raise BuildError(f"calibration table {path}: range of {name!r} is not [min, max]: recalibrate")
        ranges[name] = finite_range(name, (pair[0], pair[1]))
    return ranges, method


def finite_range(name: str, pair: Any) -> tuple[float, float]:
    # ORT hands numpy scalars (Entropy) or 1-element arrays (MinMax's ReduceMin/ReduceMax outputs).
    low = float(np.min(np.asarray(pair[0], dtype=np.float64)))
    high = float(np.max(np.asarray(pair[1], dtype=np.float64)))
    if not (math.isfinite(low) and math.isfinite(high)) or low > high:
        raise BuildError(
            f"calibration range of tensor {name!r} is ({low}, {high}): not a finite [min, max]; "
            "recalibrate with frames that do not overflow"
        )
    return low, high
