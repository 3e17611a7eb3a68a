"""An AGX Orin's GPU and two DLA cores, stood in for by paced ONNX Runtime CPU sessions (a fake).

No machine here has a GPU or a DLA, so this fakes the absent hardware and only that:
:data:`STANDIN_ORIN` is a platform that claims TensorRT, a GPU and two DLA cores, so the real planner
lists ``gpu, dla0, dla1`` for ``device: auto``; :class:`StandInBuilder` builds each of those
candidates for real as an ONNX Runtime CPU engine (build child, engine cache) and reports it as
built for that device (backend ``standin``, layer placement as TensorRT would report it);
:class:`StandInBackend` loads it as a real CPU session that takes at least :data:`PACE_S` per frame
for its device. The pace models what separate accelerators do and CPU sessions on a shared 2-core
machine do not: each works at its own speed beside the others. Register the backend for a test with
``monkeypatch.setitem(BACKENDS, STANDIN, STANDIN_TARGET)``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy.typing as npt

from agent.backends.base import Backend, Feeds, LoadOptions, Outputs, Runner, get_backend
from agent.engines.building.artifact import EngineArtifact
from agent.engines.building.builder import EngineBuilder
from agent.engines.job import Progress
from agent.specs.build import BuildSpec
from agent.specs.preprocess import PreprocessSpec
from tests.engines.building.test_builder_fallback import FORCED_TRT

#: The registry key and target of the stand-in backend.
STANDIN = "standin"
STANDIN_TARGET = "tests.engines.standin_accelerators:StandInBackend"

#: An AGX Orin's accelerators for the planner: TensorRT (claimed, absent here), a GPU, two DLA cores.
STANDIN_ORIN = replace(FORCED_TRT, dla_cores=2, gpu_name="Orin (fake: GPU and DLA stood in for)")

#: Seconds per frame of each stand-in device, at least: a GPU about three times a DLA core, as the
#: figures in the issue (13 ms vs 30+ ms). Far above what the small CPU model takes, so the pace and
#: not the shared CPU sets each device's speed.
PACE_S = {"gpu": 0.02, "dla0": 0.06, "dla1": 0.06}

#: Layers of the stand-in engines, as TensorRT reports a placement.
LAYERS = 14


class StandInBuilder(EngineBuilder):
    """Builds a ``gpu``/``dla0``/``dla1`` request as a real ONNX Runtime CPU engine and reports it as
    that device's engine; any other request is built as asked."""

    def build(
        self,
        model: Path,
        spec: BuildSpec | None,
        *,
        calibration: Iterable[npt.NDArray[Any]] | None = None,
        preprocess: PreprocessSpec | None = None,
        progress: Progress | None = None,
        cancel: threading.Event | None = None,
    ) -> EngineArtifact:
        if spec is None or spec.device not in PACE_S:
            return super().build(
                model, spec, calibration=calibration, preprocess=preprocess, progress=progress, cancel=cancel
            )
        device = spec.device
        cpu = super().build(
            model,
            spec.model_copy(update={"device": "cpu", "precision": "fp32", "calibration": None}),
            preprocess=preprocess,
            progress=progress,
            cancel=cancel,
        )
        on_dla = device.startswith("dla")
        effective = {
            **cpu.effective,
            "backend": STANDIN,
            "device": "dla" if on_dla else "gpu",
            "dla_core": int(device[3:]) if on_dla else None,
            "placement": {"dla_layers": LAYERS if on_dla else 0, "gpu_layers": 0 if on_dla else LAYERS},
        }
        return replace(
            cpu, backend=STANDIN, effective=effective, load_extra={**cpu.load_extra, "standin_device": device}
        )


class PacedRunner(Runner):
    """A real CPU session whose every call takes at least ``pace_s``: one stand-in accelerator."""

    backend = STANDIN

    def __init__(self, inner: Runner, pace_s: float) -> None:
        super().__init__(inner.inputs, inner.outputs)
        self.inner = inner
        self.pace_s = pace_s

    def _infer(self, feeds: Feeds) -> Outputs:
        started = time.perf_counter()
        outputs = self.inner.infer(feeds)
        time.sleep(max(0.0, self.pace_s - (time.perf_counter() - started)))
        return outputs

    def _close(self) -> None:
        self.inner.close()

    def describe(self) -> dict[str, Any]:
        return {**self.inner.describe(), "backend": STANDIN}


class StandInBackend(Backend):
    """Loads a :class:`StandInBuilder` engine as a paced CPU session (one ORT thread: the pace, not
    the host CPU, is the device)."""

    key = STANDIN

    def available(self) -> tuple[bool, str]:
        return True, "CPU sessions standing in for the GPU and DLA cores (fake)"

    def load(self, engine: Path, options: LoadOptions) -> Runner:
        device = str(options.extra.get("standin_device", "gpu"))
        extra = {k: v for k, v in options.extra.items() if k != "standin_device"}
        inner = get_backend("onnxruntime").load(engine, replace(options, intra_op_threads=1, extra=extra))
        return PacedRunner(inner, PACE_S[device])
