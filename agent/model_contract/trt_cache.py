"""TensorRT's INT8 calibration cache, read and written in TensorRT's own text format.

The format (what ``IInt8Calibrator.write_calibration_cache`` hands over)::

    TRT-100300-EntropyCalibration2
    input: 3c010a14
    conv1/Relu:0: 3d4ccccd

The first line is ``TRT-<version tag>-<algorithm>``; each further line is ``<tensor name>: <8 hex
digits>``, the big-endian IEEE float32 bit pattern of the tensor's scale ``amax / 127``. Tensor names
may themselves contain ``:`` (TensorFlow-exported models), so a line splits on its last colon.

The version tag is TensorRT's ``NV_TENSORRT_VERSION``: four digits below TensorRT 10 (8.5.2 ->
``8502``), six from 10 on (10.3.0 -> ``100300``). TensorRT ignores a cache from another version
(TensorRT#1378) or rejects it and recalibrates (10.3 refusing ``TRT-8600``), so
:func:`check_cache_version` refuses a mismatch up front with a message that says what to do.

:func:`from_ort_ranges` turns ONNX Runtime's calibration ranges into TensorRT scales, so a cache
calibrated with ONNX Runtime on any machine can feed a Jetson build.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.errors import BuildError

#: Largest magnitude of a symmetric INT8 value; scale = amax / INT8_MAX.
INT8_MAX = 127.0

#: Scale written for a tensor whose calibrated range is all zeros: any positive scale keeps zero at
#: zero, and a zero scale would make TensorRT divide by zero when it quantizes.
_ZERO_RANGE_SCALE = 1.0 / INT8_MAX

_HEADER_RE = re.compile(r"TRT-(?P<tag>\d+)-(?P<algorithm>[A-Za-z][A-Za-z0-9_]*)")
_HEX_RE = re.compile(r"[0-9a-fA-F]{8}")
_VERSION_RE = re.compile(r"(?P<major>\d+)\.(?P<minor>\d+)(?:\.(?P<patch>\d+))?(?:\.\d+)*")

#: The algorithms TensorRT names in cache headers (``CalibrationAlgoType``).
KNOWN_ALGORITHMS = frozenset(
    {"EntropyCalibration2", "EntropyCalibration", "MinMaxCalibration", "LegacyCalibration"}
)


@dataclass(frozen=True)
class TrtCalibrationCache:
    """A parsed calibration cache: version tag (``100300``), algorithm, and scale per tensor."""

    version_tag: int
    algorithm: str
    scales: dict[str, float] = field(default_factory=dict)

    @property
    def trt_version(self) -> str:
        """The TensorRT version that wrote the cache, as ``major.minor.patch``."""
        return version_from_tag(self.version_tag)


def parse_trt_version(version: str) -> tuple[int, int, int]:
    """``'10.3.0.30'`` -> ``(10, 3, 0)``; ``'8.6'`` -> ``(8, 6, 0)``. BuildError when it does not parse."""
    match = _VERSION_RE.fullmatch(version.strip())
    if match is None:
        raise BuildError(f"TensorRT version {version!r} does not parse: expected major.minor[.patch]")
    return int(match["major"]), int(match["minor"]), int(match["patch"] or 0)


def trt_version_tag(version: str) -> int:
    """TensorRT's ``NV_TENSORRT_VERSION`` number for a version string.

    8.x and older use ``major*1000 + minor*100 + patch`` (``'8.5.2'`` -> ``8502``); 10 and newer
    use ``major*10000 + minor*100 + patch`` (``'10.3.0'`` -> ``100300``).
    """
    major, minor, patch = parse_trt_version(version)
    if major >= 10:
        if minor > 99 or patch > 99:
            raise BuildError(f"TensorRT version {version!r} does not fit a cache version tag")
        return major * 10000 + minor * 100 + patch
    if minor > 9 or patch > 99:
        raise BuildError(f"TensorRT version {version!r} does not fit a cache version tag")
    return major * 1000 + minor * 100 + patch


def version_from_tag(tag: int) -> str:
    """Inverse of :func:`trt_version_tag`: ``8502`` -> ``'8.5.2'``, ``100300`` -> ``'10.3.0'``."""
    if tag >= 100000:
        return f"{tag // 10000}.{(tag // 100) % 100}.{tag % 100}"
    return f"{tag // 1000}.{(tag // 100) % 10}.{tag % 100}"


def scale_to_hex(scale: float) -> str:
    """Big-endian float32 bit pattern of ``scale`` as 8 lowercase hex digits (1.0 -> ``3f800000``)."""
    return struct.pack(">f", scale).hex()


def hex_to_scale(digits: str) -> float:
    """Inverse of :func:`scale_to_hex`."""
    value: float = struct.unpack(">f", bytes.fromhex(digits))[0]
    return value


def _check_scale(name: str, scale: float) -> None:
    if not math.isfinite(scale) or scale < 0:
        raise BuildError(f"calibration scale of tensor {name!r} is {scale}: scales must be finite and >= 0")
    if scale > 3.4028234663852886e38:
        raise BuildError(f"calibration scale of tensor {name!r} is {scale}: too large for float32")


def write_trt_cache(
    scales: Mapping[str, float], trt_version: str, algorithm: str = "EntropyCalibration2"
) -> bytes:
    """Serialize ``scales`` (tensor name -> amax/127) as a TensorRT calibration cache for ``trt_version``.

    Tensors keep the mapping's order (TensorRT writes network order). Scales are rounded to float32.
    """
    if algorithm not in KNOWN_ALGORITHMS:
        raise BuildError(
            f"calibration algorithm {algorithm!r} is not one TensorRT writes; "
            f"use one of {', '.join(sorted(KNOWN_ALGORITHMS))}"
        )
    lines = [f"TRT-{trt_version_tag(trt_version)}-{algorithm}"]
    for name, scale in scales.items():
        if not name or not name.isascii() or "\n" in name or "\r" in name or name != name.strip():
            raise BuildError(f"tensor name {name!r} cannot be written to a calibration cache")
        _check_scale(name, float(scale))
        lines.append(f"{name}: {scale_to_hex(float(scale))}")
    return ("\n".join(lines) + "\n").encode("ascii")


def read_trt_cache(data: bytes) -> TrtCalibrationCache:
    """Parse a TensorRT calibration cache. BuildError naming the line when it is malformed."""
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError as exc:
        raise BuildError(
            f"calibration cache is not ASCII text (byte {exc.start}): not a TensorRT calibration cache"
        ) from exc
    lines = text.splitlines()
    if not lines:
        raise BuildError("calibration cache is empty: expected a 'TRT-<version>-<algorithm>' header")
    header = _HEADER_RE.fullmatch(lines[0].strip())
    if header is None:
        raise BuildError(
            f"calibration cache line 1: header {lines[0][:80]!r} is not 'TRT-<version>-<algorithm>' "
            "(e.g. TRT-100300-EntropyCalibration2)"
        )
    scales: dict[str, float] = {}
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue  # tolerate blank lines, e.g. a trailing newline twice
        name, sep, digits = line.rpartition(":")
        name, digits = name.strip(), digits.strip()
        if not sep or not name:
            raise BuildError(
                f"calibration cache line {number}: {line[:80]!r} is not '<tensor>: <8 hex digits>'"
            )
        if _HEX_RE.fullmatch(digits) is None:
            raise BuildError(
                f"calibration cache line {number}: scale {digits[:20]!r} of tensor {name!r} "
                "is not 8 hex digits"
            )
        if name in scales:
            raise BuildError(f"calibration cache line {number}: tensor {name!r} appears twice")
        scale = hex_to_scale(digits)
        if not math.isfinite(scale) or scale < 0:
            raise BuildError(
                f"calibration cache line {number}: scale of tensor {name!r} is {scale}: "
                "a scale must be finite and >= 0"
            )
        scales[name] = scale
    return TrtCalibrationCache(int(header["tag"]), header["algorithm"], scales)


def check_cache_version(cache: TrtCalibrationCache, running_trt_version: str) -> None:
    """Refuse a cache written by another TensorRT version than the one running here.

    TensorRT would silently ignore such a cache or recalibrate (TensorRT#1378), so the build would
    not use the scales the operator supplied.
    """
    running_tag = trt_version_tag(running_trt_version)
    if cache.version_tag != running_tag:
        raise BuildError(
            f"calibration cache was written by TensorRT {cache.trt_version} (TRT-{cache.version_tag}) "
            f"but this device runs TensorRT {running_trt_version} (TRT-{running_tag}); "
            "TensorRT ignores or rejects a cache from another version. Recalibrate on this device, "
            "or rewrite the cache for this version from its scales if the model is unchanged"
        )


def from_ort_ranges(ranges: Mapping[str, tuple[float, float]]) -> dict[str, float]:
    """ONNX Runtime's calibration ranges ``{tensor: (min, max)}`` -> TensorRT scales.

    ``amax = max(|min|, |max|)``, ``scale = amax / 127`` (symmetric INT8, as TensorRT uses). The
    values may be numpy scalars (what ``TensorsData`` holds). A tensor whose range is all zeros gets
    scale 1/127. The names are ONNX tensor names, which TensorRT's ONNX parser keeps.
    """
    scales: dict[str, float] = {}
    for name, (low, high) in ranges.items():
        low_f, high_f = float(low), float(high)
        if not (math.isfinite(low_f) and math.isfinite(high_f)):
            raise BuildError(
                f"calibration range of tensor {name!r} is ({low_f}, {high_f}): not finite; "
                "recalibrate with data that does not overflow"
            )
        amax = max(abs(low_f), abs(high_f))
        scales[name] = amax / INT8_MAX if amax > 0 else _ZERO_RANGE_SCALE
    return scales
