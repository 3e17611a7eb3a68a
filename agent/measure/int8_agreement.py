"""How close an INT8 build stays to the FP32 model, on the images it was calibrated on.

``edge-agent build --precision int8 --calib DIR`` reports it, so that an operator sees
what quantization cost: the ONNX model on ONNX Runtime's CPU provider in FP32 is the reference, the
built engine the candidate; both run on up to :data:`MAX_FRAMES` of the calibration images,
preprocessed as the calibration was, through the same measure the device's INT8 guard applies
(:func:`agent.engines.guard.agreement.agreement`): ``top1_agreement`` is the share of frames whose arg-max of
the first output is the same, ``max_abs_diff`` the largest score difference.

Beside :mod:`agent.measure.throughput`, above ``backends`` and ``engines``: it loads both.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agent.backends.base import LoadOptions, get_backend
from agent.engines.building.artifact import EngineArtifact
from agent.engines.building.ort import CPU_EP
from agent.engines.calibration.data import dataset_images
from agent.engines.guard.agreement import agreement
from agent.errors import AgentError
from agent.specs.preprocess import PreprocessSpec

#: Most calibration images the comparison runs (a few seconds on a CPU).
MAX_FRAMES = 50


@dataclass(frozen=True)
class Int8Agreement:
    """The INT8 build against FP32 on ``frames`` calibration images; ``skipped`` says why not."""

    frames: int = 0
    output: str | None = None
    top1_agreement: float | None = None
    max_abs_diff: float | None = None
    skipped: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        """The ``agreement`` line of the build report."""
        if self.skipped is not None:
            return f"not measured: {self.skipped}"
        top1 = "n/a" if self.top1_agreement is None else f"{self.top1_agreement * 100:.1f} %"
        diff = "n/a" if self.max_abs_diff is None else f"{self.max_abs_diff:.3g}"
        return (
            f"INT8 vs FP32 on {self.frames} calibration image(s): top-1 agreement {top1} "
            f"(output {self.output}), max abs diff {diff}"
        )


def int8_agreement(
    model: Path, artifact: EngineArtifact, images: Path, preprocess: PreprocessSpec, frames: int = MAX_FRAMES
) -> Int8Agreement:
    """Run the FP32 reference and the built engine on the calibration images and compare them with
    the engines' own INT8 accuracy guard (:func:`agent.engines.guard.agreement.agreement`)."""
    import cv2

    try:
        reference = get_backend("onnxruntime").load(model, LoadOptions(providers=(CPU_EP,)))
    except AgentError as exc:
        return Int8Agreement(skipped=f"the FP32 reference did not load: {exc}")
    try:
        candidate = get_backend(artifact.backend).load(artifact.engine_path, artifact.load_options())
    except AgentError as exc:
        reference.close()
        return Int8Agreement(skipped=f"the INT8 engine did not load: {exc}")
    try:
        read = (cv2.imread(str(path), cv2.IMREAD_COLOR) for path in dataset_images(images)[:frames])
        bgr = (image.astype(np.uint8, copy=False) for image in read if image is not None)
        report = agreement(reference, candidate, bgr, preprocess)
    except AgentError as exc:
        return Int8Agreement(skipped=str(exc))
    finally:
        candidate.close()
        reference.close()
    if not report.n:
        return Int8Agreement(skipped="no calibration image could be read")
    return Int8Agreement(
        frames=report.n,
        output=report.output,
        top1_agreement=report.agreement,
        max_abs_diff=report.max_abs_diff,
    )
