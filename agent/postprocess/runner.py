"""The postprocess a slot runs per frame, chosen by the spec's ``type``, and its load-time check."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy.typing as npt
import structlog

from agent.camera.preprocess import Letterbox
from agent.model_contract.outputs import validate_outputs
from agent.model_contract.tensors import TensorSpec, pick_output_spec
from agent.postprocess.classification import ClassificationPostprocess
from agent.postprocess.detection import DetectionPostprocess
from agent.postprocess.labels import load_labels
from agent.postprocess.raw import RawPostprocess
from agent.protocol.results import Prediction
from agent.specs.postprocess import ClassificationSpec, DetectionSpec, PostprocessSpec

log = structlog.get_logger(__name__)


class Postprocessor:
    """Turns one item's outputs (batch axis removed) into a :class:`Prediction`.

    Labels are loaded once here; ``labels_file`` is relative to ``base_dir`` (the config's folder).
    """

    def __init__(self, spec: PostprocessSpec, *, base_dir: Path | None = None) -> None:
        self.spec = spec
        self.labels: list[str] = []
        self._classify: ClassificationPostprocess | None = None
        self._detect: DetectionPostprocess | None = None
        self._raw: RawPostprocess | None = None
        if isinstance(spec, ClassificationSpec):
            self.labels = load_labels(spec.labels, spec.labels_file, base_dir)
            self._classify = ClassificationPostprocess(spec, self.labels)
        elif isinstance(spec, DetectionSpec):
            self.labels = load_labels(spec.labels, spec.labels_file, base_dir)
            self._detect = DetectionPostprocess(spec, self.labels)
        else:
            self._raw = RawPostprocess(spec)

    def validate(self, outputs: Sequence[TensorSpec]) -> None:
        """:func:`validate_outputs`, plus a warning when the labels do not match the class count."""
        validate_outputs(self.spec, outputs)
        classes = self._class_count(outputs)
        if self.labels and classes is not None and classes != len(self.labels):
            log.warning("postprocess.labels.mismatch", labels=len(self.labels), classes=classes)

    def __call__(self, outputs: Mapping[str, npt.NDArray[Any]], lb: Letterbox) -> Prediction:
        if self._detect is not None:
            return self._detect(outputs, lb)
        if self._classify is not None:
            return self._classify(outputs)
        assert self._raw is not None
        return self._raw(outputs)

    def _class_count(self, outputs: Sequence[TensorSpec]) -> int | None:
        spec = self.spec
        if isinstance(spec, ClassificationSpec):
            dims = [d for d in pick_output_spec(outputs, spec.output_name).shape[1:] if d != 1]
            return dims[0] if len(dims) == 1 and isinstance(dims[0], int) else None
        if isinstance(spec, DetectionSpec):
            shape = pick_output_spec(outputs, spec.output_name).shape
            channels = shape[1] if spec.format == "yolov8" else shape[2]
            return channels - (4 if spec.format == "yolov8" else 5) if isinstance(channels, int) else None
        return None
