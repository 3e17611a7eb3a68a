"""Checks a delivered model before anything is built from it: size, ONNX validity, slot fit.

Runs on the ONNX graph only (no inference framework), so an unusable model is refused in
VERIFYING with a precise code, long before an engine build or a load could fail on it.
"""

from __future__ import annotations

from pathlib import Path

from agent.errors import EngineError
from agent.model_contract.graph import graph_io, load_checked
from agent.model_contract.input_fit import check_input_fits, select_input
from agent.model_contract.outputs import validate_outputs
from agent.protocol.delivery_errors import IncompatibleError, TooLargeError
from agent.protocol.manifest import DeployManifest
from agent.specs.postprocess import PostprocessSpec
from agent.specs.preprocess import PreprocessSpec


def verify_model(
    path: Path,
    manifest: DeployManifest,
    *,
    max_bytes: int,
    preprocess: PreprocessSpec,
    postprocess: PostprocessSpec,
) -> None:
    """Raise a RejectedError (too_large, bad_onnx, onnx_checker, incompatible) unless the model fits.

    ``preprocess``/``postprocess`` are what the slot will run with this model: the manifest's own,
    or the slot's current ones when the manifest leaves them out.
    """
    job = manifest.job_id
    size = Path(path).stat().st_size
    if size > max_bytes:
        raise TooLargeError(
            f"model is {size} bytes, larger than delivery.max_model_bytes={max_bytes}; raise the limit "
            "or deploy a smaller model",
            job_id=job,
        )
    model = load_checked(path, job_id=job)
    inputs, outputs = graph_io(model)
    try:
        check_input_fits(preprocess, select_input(preprocess, inputs))
        validate_outputs(postprocess, outputs)
    except EngineError as exc:
        raise IncompatibleError(f"model does not fit slot {manifest.slot!r}: {exc}", job_id=job) from exc
