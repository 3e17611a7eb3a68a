"""What a deploy sends where: the plan, its job id and its manifest sequence, the ``--device`` list."""

from __future__ import annotations

import itertools
import re
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.protocol.device_targets import AGENT_TARGET, CONFIG_TARGET
from agent.protocol.manifest import DEFAULT_CHUNK_SIZE
from agent.protocol.proving import ProbationSpec, ShadowSpec
from agent.specs.build import BuildSpec
from agent.specs.postprocess import PostprocessSpec
from agent.specs.preprocess import PreprocessSpec

#: Seconds of probation ``fleet deploy`` asks for unless ``--probation-s`` says otherwise. The
#: default is the operator tool's, not the manifest's: a manifest without ``probation_s`` keeps
#: meaning "no probation" (older manifests, older agents), and a DeployPlan keeps None.
DEFAULT_PROBATION_S = 60.0

#: The model id a device target's desired state carries (what a release binds and up/info names).
TARGET_MODEL_IDS = {CONFIG_TARGET: "config", AGENT_TARGET: "edge-agent"}
#: A device target's watch window unless the operator says otherwise, seconds: a configuration is
#: watched for a minute, a new agent has two to start and report healthy.
TARGET_PROBATION_S = {CONFIG_TARGET: 60.0, AGENT_TARGET: 120.0}
#: The file name a target's document is uploaded under (the repository keeps it by SHA-256).
TARGET_DOCUMENT_NAMES = {CONFIG_TARGET: "config.yaml", AGENT_TARGET: "agent-release.json"}

_JOB_ID_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


class _SequenceClock:
    """Milliseconds since the epoch, never the same value twice in this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = 0

    def next(self) -> int:
        with self._lock:
            self._last = max(self._last + 1, time.time_ns() // 1_000_000)
            return self._last


_SEQUENCE = _SequenceClock()


def next_sequence() -> int:
    """A manifest sequence number: Unix time in milliseconds, strictly increasing in this process.

    Time-based so that a later deploy outranks an earlier one from any operator machine whose clock
    is right; devices refuse a sequence that is not above the last one they accepted (``replay``).
    """
    return _SEQUENCE.next()


def new_job_id(model_id: str, version: str) -> str:
    """A unique, readable job id: ``{model_id}-{version}-{UTC time}-{random}`` in ``[A-Za-z0-9_.-]``."""
    base = _JOB_ID_UNSAFE.sub("_", f"{model_id}-{version}")
    base = re.sub(r"\.{2,}", ".", base).strip(".")[:80] or "job"
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return f"{base}-{stamp}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class DeployPlan:
    """What to deploy where (everything ``fleet deploy`` takes besides broker and key)."""

    model: Path
    devices: tuple[str, ...]
    slot: str
    version: str
    model_id: str | None = None  # default: the model file's stem
    chunk_size: int = DEFAULT_CHUNK_SIZE
    build: BuildSpec | None = None
    preprocess: PreprocessSpec | None = None
    postprocess: PostprocessSpec | None = None
    #: HTTP(S) URL of the same file; tried before the MQTT pull, which stays as the fallback.
    http_url: str | None = None
    job_id: str | None = None  # default: new_job_id()
    sequence: int | None = None  # default: next_sequence()
    #: Shadow comparison on live frames before the swap (None: none), probation after it (None/0: none).
    shadow: ShadowSpec | None = None
    probation_s: float | None = None
    probation: ProbationSpec | None = None
    #: The operator's INT8 calibration file, shipped as the manifest artifact :data:`CALIBRATION_ARTIFACT`.
    calib_cache: Path | None = None
    #: HTTP(S) URL of the same calibration file; devices try it first, then the MQTT pull.
    calib_http_url: str | None = None
    #: Devices ask the controller for the engine and offer theirs (docs/engines.md); None: they do not.
    share_engines: bool | None = None
    #: A way back to a model the devices served before (manifest ``rollback``): no shadow, no probation.
    rollback: bool = False
    #: An agent release's wheels (target ``_agent``): (file name, path), each a ``wheel`` artifact.
    wheels: tuple[tuple[str, Path], ...] = ()


#: The name ``fleet deploy --calib-cache`` gives the calibration artifact (build.calibration.artifact).
CALIBRATION_ARTIFACT = "calibration"


def parse_devices(values: Sequence[str]) -> tuple[str, ...]:
    """Devices from repeated/comma-separated ``--device`` values, order kept, duplicates dropped."""
    seen: dict[str, None] = {}
    for value in itertools.chain.from_iterable(v.split(",") for v in values):
        if value.strip():
            seen.setdefault(value.strip(), None)
    return tuple(seen)
