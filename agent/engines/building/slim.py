"""OnnxSlim before every engine build: ONNX -> OnnxSlim -> engine, as the seed's TensorRT pipeline does.

``onnxslim`` folds constants, removes dead and duplicate nodes and fuses simple patterns, so the
engine builder (TensorRT's parser, ONNX Runtime's optimizer) starts from a smaller graph with the
same outputs. :func:`slim_model` runs in the build child (a pathological graph cannot take the agent
down) and caches the slimmed model by the input's hash and the onnxslim version under
``<state_dir>/slim/``; the build report carries the node counts before and after. A build spec with
``slim: false`` skips it (and gets a different engine key: ``slim`` is a plan field).
"""

from __future__ import annotations

import importlib.metadata
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from agent.errors import BuildError
from agent.fsutil import atomic_write_bytes, atomic_write_json


@dataclass(frozen=True)
class SlimResult:
    """The slimmed model to build from, and what slimming did."""

    path: Path
    nodes_before: int
    nodes_after: int
    onnxslim_version: str
    cached: bool = False

    def report(self) -> dict[str, int | str | bool]:
        """For the build report and job status (``effective.slim``)."""
        out = asdict(self)
        out["path"] = str(self.path)
        return out


def onnxslim_version() -> str | None:
    """The installed onnxslim version (without importing it), or None when it is not installed."""
    try:
        return importlib.metadata.version("onnxslim")
    except importlib.metadata.PackageNotFoundError:
        return None


def slim_model(model: Path, model_sha256: str, cache_dir: Path) -> SlimResult:
    """``model`` slimmed by onnxslim, from ``cache_dir`` when this input and version were slimmed before.

    Raises BuildError when onnxslim is missing or fails on the model (the operator can set
    ``slim: false`` in the build spec to build from the model as given).
    """
    version = onnxslim_version()
    if version is None:
        raise BuildError(
            "onnxslim is not installed: reinstall the agent (it is a dependency), or set slim: false "
            "in the build spec"
        )
    stem = f"{model_sha256}-onnxslim{re.sub(r'[^A-Za-z0-9.]+', '_', version)}"
    slimmed, meta = cache_dir / f"{stem}.onnx", cache_dir / f"{stem}.json"
    try:
        facts = json.loads(meta.read_text(encoding="utf-8"))
        if slimmed.is_file():
            return SlimResult(slimmed, int(facts["nodes_before"]), int(facts["nodes_after"]), version, True)
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not cached, or a torn/odd sidecar: slim again (the writes below are atomic)
    import onnx
    import onnxslim

    try:
        original = onnx.load(str(model))
        before = len(original.graph.node)
        result = onnxslim.slim(original)
    except Exception as exc:
        raise BuildError(
            f"onnxslim failed on {model.name}: {type(exc).__name__}: {exc} (set slim: false in the build "
            "spec to build from the model as given)"
        ) from exc
    if not isinstance(result, onnx.ModelProto):
        raise BuildError(f"onnxslim returned {type(result).__name__}, not a model, for {model.name}")
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Model first, then the sidecar: a sidecar is only ever next to a complete model.
    atomic_write_bytes(slimmed, result.SerializeToString())
    after = len(result.graph.node)
    atomic_write_json(meta, {"nodes_before": before, "nodes_after": after, "onnxslim": version})
    return SlimResult(slimmed, before, after, version, False)
