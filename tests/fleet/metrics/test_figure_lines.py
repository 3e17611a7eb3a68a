"""A device's telemetry lines written from a layout's template are the lines written one by one:
every value (NaN and infinities by their exposition names), every label a device may choose (braces,
a NUL, a lone surrogate), a series repeated after cutting written once."""

from __future__ import annotations

import math

from agent.fleet.metrics.figure_lines import figure_text, layout_of
from agent.fleet.metrics.text import escape, labels_text, number
from agent.telemetry.series import LABEL_VALUE_LIMIT, series_of


def one_by_one(figures: dict[str, float], dev: str) -> list[bytes]:
    """The lines as the exposition format says, each formatted on its own (families first seen first)."""
    by_family: dict[str, list[str]] = {}
    seen: set[tuple[str, str]] = set()
    for name, value in figures.items():
        series = series_of(name)
        if series is None:
            continue
        rest = labels_text(series.labels)
        if (series.metric, rest) in seen:
            continue
        seen.add((series.metric, rest))
        labels = f'device="{dev}"' + (f",{rest}" if rest else "")
        line = f"{series.metric}{{{labels}}} {number(value * series.scale)}\n"
        by_family.setdefault(series.metric, []).append(line)
    return ["".join(lines).encode("utf-8", "replace") for lines in by_family.values()]


FIGURES = {
    "stream.cam0.fps": 29.91,
    "stream.cam0.frames_published": 51234.0,
    "stream.cam1.fps": 12.0,
    "stream.cam0.latency.total.p95_ms": 11.27,
    "slot.main.latency.infer.p95_ms": 7.67,
    "process.rss_mb": 310.4,
    "cpu.percent": 40.3,
    "gpu.freq_mhz": 918.0,
    "something.new": 1.0,
}


def test_the_template_writes_what_line_by_line_writes() -> None:
    got = figure_text(layout_of(tuple(FIGURES)), FIGURES, "jet-a")
    assert got == one_by_one(FIGURES, "jet-a")
    assert (
        b'edge_stream_latency_seconds{device="jet-a",stream="cam0",stage="total",quantile="0.95"} 0.01127\n'
        in got
    )
    assert b'edge_process_resident_memory_bytes{device="jet-a"} 325477990.4\n' in got


def test_nan_and_infinities_are_written_by_their_exposition_names() -> None:
    figures = {**FIGURES, "cpu.percent": math.nan, "gpu.freq_mhz": math.inf, "process.rss_mb": -math.inf}
    got = figure_text(layout_of(tuple(figures)), figures, "jet-a")
    assert got == one_by_one(figures, "jet-a")
    text = b"".join(got)
    assert b'edge_cpu_percent{device="jet-a"} NaN\n' in text
    assert b'edge_clock_hertz{device="jet-a",clock="gpu"} +Inf\n' in text
    assert b'edge_process_resident_memory_bytes{device="jet-a"} -Inf\n' in text


def test_labels_a_device_chose_with_braces_a_nul_quotes_or_a_surrogate_are_written_as_they_are() -> None:
    for stream in ("c{0}m", "c}{am", "x\x00y", 'q"uote\\', "s\ud800rr"):
        figures = {f"stream.{stream}.fps": 1.5, "cpu.percent": 2.0, f"stream.{stream}.capture_fps": 3.0}
        dev = escape('dev"{1}')
        got = figure_text(layout_of(tuple(figures)), figures, dev)
        assert got == one_by_one(figures, dev), stream
        assert len(got) == 3


def test_two_figures_that_are_one_series_after_cutting_are_written_once() -> None:
    long = "s" * (LABEL_VALUE_LIMIT + 10)
    figures = {f"stream.{long}a.fps": 1.0, f"stream.{long}b.fps": 2.0}
    got = figure_text(layout_of(tuple(figures)), figures, "jet")
    assert got == one_by_one(figures, "jet")
    assert b"".join(got).count(b"\n") == 1


def test_a_message_no_rule_knows_has_no_lines() -> None:
    figures = {"something.new": 1.0}
    assert figure_text(layout_of(tuple(figures)), figures, "jet") == []
    assert figure_text(layout_of(()), {}, "jet") == []
