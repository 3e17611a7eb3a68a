"""What a manifest asks a new model to prove on the device: ``shadow`` before the swap, ``probation`` after.

Both are optional per manifest (docs/protocol.md, "Shadow and probation"). The shadow bar says how
many live frames the candidate runs beside the serving model, how much it must agree with it and how
much slower it may be; the probation bars say how far the new model's live health may fall from the
baseline the old model set before the swap. These are plain settings models (ground-floor style):
the runtime does the measuring, :mod:`agent.runtime.slots.agreement` and
:mod:`agent.runtime.slots.health` judge.
"""

from __future__ import annotations

from pydantic import Field

from agent.model_base import StrictModel


class ShadowSpec(StrictModel):
    """Run the candidate on sampled live frames beside the serving model before swapping it in."""

    frames: int = Field(30, ge=1, le=100_000, description="Frames to compare (the run may stop earlier).")
    min_agreement: float | None = Field(
        0.9,
        ge=0.0,
        le=1.0,
        description="Least mean agreement with the serving model; null for a model whose classes or "
        "output layout change on purpose (only latency and NaN checks apply then).",
    )
    max_latency_ratio: float = Field(
        2.0,
        gt=0.0,
        description="Most the candidate's median inference time may be, as a multiple of the old.",
    )
    timeout_s: float = Field(
        120.0, gt=0.0, le=3600.0, description="Longest the shadow runs; then it judges the frames it has."
    )
    sample_fps: float = Field(
        5.0, gt=0.0, le=60.0, description="Most frames per second sampled (bounds the extra load)."
    )


class ProbationSpec(StrictModel):
    """How far the new model's live health may fall from the old model's baseline during probation."""

    min_fps_ratio: float = Field(
        0.8,
        ge=0.0,
        le=1.0,
        description="Least published fps per stream, as a share of the baseline's (or of the fps the "
        "capture handed the new model, when lower).",
    )
    max_p99_ratio: float = Field(
        3.0,
        gt=0.0,
        description="Most the new model's inference time may be, as a multiple of the old model's timed "
        "on the same live frames at the same moments (median of the per-frame ratios, over the whole "
        "probation and over its latter half).",
    )
    max_infer_errors: int = Field(0, ge=0, description="Inference errors tolerated (0: the first one fails).")
    max_nan_outputs: int = Field(0, ge=0, description="Frames with NaN/Inf outputs tolerated.")
    max_drop_increase: float = Field(
        0.1, ge=0.0, le=1.0, description="Most the share of frames dropped may rise above the baseline's."
    )
    max_class_shift: float | None = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Classifiers: most total-variation distance between the top-1 class mix and the "
        "baseline's (null: not checked, e.g. the scene changes on purpose).",
    )
    baseline_s: float = Field(
        120.0, gt=0.0, le=3600.0, description="How far back before the swap the baseline reaches."
    )
