"""The INT8 accuracy guard: an INT8 engine goes live only if it agrees with the FP32 model.

Before an INT8 engine replaces anything, :func:`agreement` runs the FP32 and the INT8 runner on the
same held-out frames (preprocessed exactly as the slot will) and measures how often their top-1
answers agree and how far their scores are apart. :func:`check_int8` is the pure decision: below
the configured share (``EngineConfig.int8_agreement``) the orchestrator falls back to FP16/FP32
and publishes the reason.

Agreement with FP32 needs no labels, so the guard works on live frames from the device's own
camera, which is what matters: calibration that does not cover the scene shows up here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from agent.backends.base import Runner
from agent.camera.frame import Frame
from agent.camera.preprocess import preprocess as preprocess_frame
from agent.errors import BuildError, EngineError
from agent.specs.preprocess import PreprocessSpec

#: A preprocessing step: a spec (run through the agent's own preprocessing) or any image -> tensor function.
Preprocess = PreprocessSpec | Callable[[npt.NDArray[np.uint8]], npt.NDArray[Any]]

#: Frames per inference call when the runners accept any batch size.
DEFAULT_BATCH = 16


@dataclass(frozen=True)
class GuardReport:
    """How an INT8 runner compares with the FP32 runner on ``n`` held-out frames.

    ``agreement`` is the share of frames whose top-1 (argmax of the compared output, per frame)
    is the same; the score differences are over every element of that output.
    """

    n: int
    agreement: float
    mean_abs_diff: float
    max_abs_diff: float
    output: str

    def to_dict(self) -> dict[str, Any]:
        """Flat JSON-ready form for job status and telemetry."""
        return asdict(self)


def agreement(
    fp32_runner: Runner,
    int8_runner: Runner,
    frames: Iterable[Frame | npt.NDArray[np.uint8]],
    preprocess: Preprocess,
    *,
    output: str | None = None,
    batch: int = DEFAULT_BATCH,
) -> GuardReport:
    """Run both runners on ``frames`` and compare their ``output`` (default: the first output).

    ``frames`` are BGR images or :class:`Frame` objects; both runners get the same tensors.
    An inference failure is a :class:`BuildError`: an INT8 engine that cannot run cannot go live.
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    input_name = _input_name(fp32_runner, preprocess)
    output_name = output or fp32_runner.outputs[0].name
    batch = min(batch, *(r.max_batch or batch for r in (fp32_runner, int8_runner)))
    n = agree = 0
    abs_sum = 0.0
    elements = 0
    abs_max = 0.0
    for tensors in _batches(frames, preprocess, batch):
        reference = _scores(fp32_runner, "FP32", input_name, tensors, output_name)
        candidate = _scores(int8_runner, "INT8", input_name, tensors, output_name)
        if reference.shape != candidate.shape:
            raise BuildError(
                f"INT8 output {output_name!r} has shape {candidate.shape}, FP32 has {reference.shape}: "
                "the quantized model is not the same network; rebuild it"
            )
        agree += int(np.count_nonzero(reference.argmax(axis=1) == candidate.argmax(axis=1)))
        diff = np.abs(reference.astype(np.float64) - candidate.astype(np.float64))
        abs_sum += float(diff.sum())
        elements += diff.size
        abs_max = max(abs_max, float(diff.max(initial=0.0)))
        n += len(reference)
    return GuardReport(
        n=n,
        agreement=agree / n if n else 0.0,
        mean_abs_diff=abs_sum / elements if elements else 0.0,
        max_abs_diff=abs_max,
        output=output_name,
    )


def check_int8(report: GuardReport, threshold: float) -> tuple[bool, str]:
    """Whether the INT8 engine may go live, and a one-line reason either way (pure)."""
    if report.n == 0:
        return False, (
            "INT8 accuracy guard had no held-out frames to compare on; falling back to FP16/FP32. "
            "Check that the stream delivers frames"
        )
    measured = (
        f"INT8 top-1 agrees with FP32 on {report.agreement:.1%} of {report.n} held-out frames "
        f"(mean |score diff| {report.mean_abs_diff:.4g})"
    )
    if report.agreement < threshold:
        return False, (
            f"{measured}, below the required {threshold:.1%}; falling back to FP16/FP32. "
            "Recalibrate on frames that cover the scene, or lower engines.int8_agreement"
        )
    return True, f"{measured}, required {threshold:.1%}"


def _input_name(runner: Runner, preprocess: Preprocess) -> str:
    if isinstance(preprocess, PreprocessSpec) and preprocess.input_name:
        return preprocess.input_name
    if not runner.inputs:
        raise BuildError("the FP32 model has no inputs: check the ONNX file")
    return runner.inputs[0].name


def _tensor(image: npt.NDArray[np.uint8], preprocess: Preprocess) -> npt.NDArray[Any]:
    if isinstance(preprocess, PreprocessSpec):
        return preprocess_frame(image, preprocess)[0]
    return preprocess(image)


def _batches(
    frames: Iterable[Frame | npt.NDArray[np.uint8]], preprocess: Preprocess, size: int
) -> Iterator[npt.NDArray[Any]]:
    pending: list[npt.NDArray[Any]] = []
    for frame in frames:
        image = frame.image if isinstance(frame, Frame) else frame
        pending.append(_tensor(image, preprocess))
        if len(pending) == size:
            yield np.stack(pending)
            pending = []
    if pending:
        yield np.stack(pending)


def _scores(
    runner: Runner, label: str, input_name: str, tensors: npt.NDArray[Any], output: str
) -> npt.NDArray[np.float32]:
    try:
        outputs = runner.infer({input_name: tensors})
    except EngineError as exc:
        raise BuildError(f"{label} engine failed during the INT8 accuracy guard: {exc}") from exc
    if output not in outputs:
        raise BuildError(f"{label} engine has no output {output!r}; outputs: {', '.join(sorted(outputs))}")
    scores = np.asarray(outputs[output], dtype=np.float32)
    # Top-1 per frame over everything the output holds for that frame (classes, or flattened maps).
    return scores.reshape(len(tensors), -1)
