"""TensorRT calibration cache format: header tags, hex scales, round trips, malformed input."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from agent.errors import BuildError
from agent.model_contract.trt_cache import (
    TrtCalibrationCache,
    check_cache_version,
    from_ort_ranges,
    parse_trt_version,
    read_trt_cache,
    scale_to_hex,
    trt_version_tag,
    version_from_tag,
    write_trt_cache,
)


@pytest.mark.parametrize(
    ("version", "tag"),
    [
        ("8.5.2", 8502),
        ("8.5.2.2", 8502),
        ("8.6.2", 8602),
        ("8.6", 8600),
        ("7.1.3", 7103),
        ("10.3.0", 100300),
        ("10.3.0.30", 100300),
        ("10.13.0.35", 101300),
        ("11.4.1", 110401),
    ],
    ids=str,
)
def test_trt_version_tag(version: str, tag: int) -> None:
    assert trt_version_tag(version) == tag
    assert parse_trt_version(version_from_tag(tag))[:2] == parse_trt_version(version)[:2]


@pytest.mark.parametrize("version", ["", "ten", "10", "10.x.0", "8.10.0", "10.3.100"])
def test_trt_version_tag_refuses(version: str) -> None:
    with pytest.raises(BuildError):
        trt_version_tag(version)


@pytest.mark.parametrize(
    ("scale", "digits"),
    [(1.0, "3f800000"), (0.5, "3f000000"), (2.0, "40000000"), (0.0, "00000000"), (1 / 127, "3c010204")],
    ids=["one", "half", "two", "zero", "one-127th"],
)
def test_scale_hex_is_big_endian_float32(scale: float, digits: str) -> None:
    assert scale_to_hex(scale) == digits
    data = write_trt_cache({"x": scale}, "10.3.0")
    assert data == f"TRT-100300-EntropyCalibration2\nx: {digits}\n".encode()


def test_known_cache_reads() -> None:
    data = b"TRT-8502-EntropyCalibration2\ninput: 3c010a14\nconv1/Relu:0: 3f800000\n"
    cache = read_trt_cache(data)
    assert cache.version_tag == 8502
    assert cache.algorithm == "EntropyCalibration2"
    assert cache.trt_version == "8.5.2"
    assert cache.scales["conv1/Relu:0"] == 1.0  # tensor names may contain ':'
    assert cache.scales["input"] == struct.unpack(">f", bytes.fromhex("3c010a14"))[0]
    assert list(cache.scales) == ["input", "conv1/Relu:0"]


@pytest.mark.parametrize(
    ("version", "header"),
    [("8.5.2", "TRT-8502-MinMaxCalibration"), ("10.3.0", "TRT-100300-MinMaxCalibration")],
    ids=["4-digit", "6-digit"],
)
def test_round_trip_exact_at_float32(version: str, header: str) -> None:
    rng = np.random.default_rng(7)
    values = rng.uniform(1e-6, 50.0, size=64).astype(np.float32)
    scales = {f"layer_{i}/out:0": float(v) for i, v in enumerate(values)}
    data = write_trt_cache(scales, version, algorithm="MinMaxCalibration")
    assert data.splitlines()[0].decode() == header
    cache = read_trt_cache(data)
    assert cache == TrtCalibrationCache(trt_version_tag(version), "MinMaxCalibration", scales)
    assert write_trt_cache(cache.scales, version, "MinMaxCalibration") == data


def test_float64_scales_round_to_float32() -> None:
    cache = read_trt_cache(write_trt_cache({"t": 0.1}, "10.3.0"))
    assert cache.scales["t"] == float(np.float32(0.1))
    assert cache.scales["t"] != 0.1


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty"),
        (b"TRT-100300\nx: 3f800000\n", "line 1"),
        (b"TensorRT-100300-EntropyCalibration2\n", "line 1"),
        (b"TRT-abc-EntropyCalibration2\n", "line 1"),
        (b"TRT-100300-EntropyCalibration2\nx: 3f80000\n", "line 2"),
        (b"TRT-100300-EntropyCalibration2\nx 3f800000\n", "line 2"),
        (b"TRT-100300-EntropyCalibration2\n: 3f800000\n", "line 2"),
        (b"TRT-100300-EntropyCalibration2\nx: 3f800000\ny: zz800000\n", "line 3"),
        (b"TRT-100300-EntropyCalibration2\nx: 3f800000\nx: 3f800000\n", "line 3.*twice"),
        (b"TRT-100300-EntropyCalibration2\nx: 7fc00000\n", "line 2.*finite"),
        (b"TRT-100300-EntropyCalibration2\nx: bf800000\n", "line 2"),
        (b"TRT-100300-EntropyCalibration2\n\xff: 3f800000\n", "not ASCII"),
    ],
    ids=[
        "empty",
        "header-no-algorithm",
        "header-wrong-prefix",
        "header-not-number",
        "seven-hex-digits",
        "no-colon",
        "no-name",
        "not-hex",
        "duplicate",
        "nan",
        "negative",
        "binary",
    ],
)
def test_malformed_caches_rejected(data: bytes, message: str) -> None:
    with pytest.raises(BuildError, match=message):
        read_trt_cache(data)


@pytest.mark.parametrize(
    ("scales", "algorithm"),
    [
        ({"x": float("nan")}, "EntropyCalibration2"),
        ({"x": -1.0}, "EntropyCalibration2"),
        ({"x": 1e39}, "EntropyCalibration2"),
        ({"bad\nname": 1.0}, "EntropyCalibration2"),
        ({"": 1.0}, "EntropyCalibration2"),
        ({"tensör": 1.0}, "EntropyCalibration2"),
        ({"x": 1.0}, "Percentile"),
    ],
    ids=["nan", "negative", "overflow", "newline-name", "empty-name", "non-ascii-name", "unknown-algorithm"],
)
def test_write_refuses_what_cannot_be_read_back(scales: dict[str, float], algorithm: str) -> None:
    with pytest.raises(BuildError):
        write_trt_cache(scales, "10.3.0", algorithm)


def test_blank_lines_tolerated() -> None:
    cache = read_trt_cache(b"TRT-100300-EntropyCalibration2\r\nx: 3f800000\r\n\n")
    assert cache.scales == {"x": 1.0}


def test_check_cache_version_accepts_same_version() -> None:
    cache = read_trt_cache(write_trt_cache({"x": 1.0}, "10.3.0"))
    check_cache_version(cache, "10.3.0.30")  # build number does not matter


@pytest.mark.parametrize(
    ("written_by", "running"), [("8.6.2", "10.3.0"), ("10.3.0", "10.4.0"), ("8.5.2", "8.6.2")]
)
def test_check_cache_version_refuses_other_version(written_by: str, running: str) -> None:
    cache = read_trt_cache(write_trt_cache({"x": 1.0}, written_by))
    with pytest.raises(BuildError, match=rf"TensorRT {written_by}.*TensorRT {running}.*Recalibrate"):
        check_cache_version(cache, running)


def test_trt_8600_header_refused_by_10_3() -> None:
    cache = read_trt_cache(b"TRT-8600-EntropyCalibration2\nx: 3f800000\n")
    with pytest.raises(BuildError, match="TRT-8600"):
        check_cache_version(cache, "10.3.0")


def test_from_ort_ranges() -> None:
    scales = from_ort_ranges(
        {
            "symmetric": (-127.0, 127.0),
            "negative_dominant": (-254.0, 3.0),
            "positive_only": (0.0, 12.7),
            "numpy": (np.float32(-1.27), np.float32(0.5)),
            "dead": (0.0, 0.0),
        }
    )
    assert scales["symmetric"] == 1.0
    assert scales["negative_dominant"] == 2.0
    assert scales["positive_only"] == pytest.approx(0.1)
    assert scales["numpy"] == pytest.approx(0.01)
    assert scales["dead"] > 0  # never a zero scale TensorRT would divide by


def test_from_ort_ranges_refuses_non_finite() -> None:
    with pytest.raises(BuildError, match="not finite"):
        from_ort_ranges({"x": (float("-inf"), 1.0)})


def test_ort_ranges_feed_a_trt_cache() -> None:
    """Ranges from an ONNX Runtime calibration (any machine) become a cache TensorRT 10.3 reads."""
    ranges = {"input": (-2.5, 2.0), "conv/out": (0.0, 6.35)}
    data = write_trt_cache(from_ort_ranges(ranges), "10.3.0")
    cache = read_trt_cache(data)
    check_cache_version(cache, "10.3.0")
    assert cache.scales["input"] == float(np.float32(2.5 / 127))
    assert cache.scales["conv/out"] == float(np.float32(6.35 / 127))
