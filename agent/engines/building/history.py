"""How long earlier builds took, per build fingerprint: the estimate a running build publishes.

Kept beside the engine cache (``engines/build_history.json``), small and bounded: the last
:data:`PER_FINGERPRINT` durations of at most :data:`MAX_FINGERPRINTS` fingerprints (the least recently
built go first). The fingerprint is the engine's identity without the versions an upgrade changes
(backend version, L4T release, CUDA version): the build after a JetPack upgrade, which the cache
cannot serve, is estimated from the builds before it. A history that cannot be read is started
afresh (an estimate is a courtesy, never a reason to fail a build).
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import structlog

from agent.engines.building.progress import estimate_from
from agent.engines.cache.key import EngineIdentity
from agent.fsutil import atomic_write_json

log = structlog.get_logger(__name__)

PER_FINGERPRINT = 5
MAX_FINGERPRINTS = 64
HISTORY_FILE = "build_history.json"
#: What an upgrade changes: left out of the fingerprint, so a rebuild after one is estimated.
_VERSIONS = {"backend_version", "l4t_release", "cuda_version"}


def build_fingerprint(identity: EngineIdentity) -> str:
    """The identity's fingerprint: a short hash of it without the versions an upgrade changes."""
    fields = identity.model_dump(mode="json", exclude=_VERSIONS)
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


class BuildHistory:
    """Durations of earlier builds per fingerprint, in ``directory/build_history.json``."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / HISTORY_FILE
        self._lock = threading.Lock()

    def durations(self, fingerprint: str) -> list[float]:
        with self._lock:
            return list(self._load().get(fingerprint, []))

    def estimate(self, fingerprint: str) -> tuple[float | None, int]:
        """The estimate (median of earlier builds) and how many builds it rests on."""
        durations = self.durations(fingerprint)
        return estimate_from(durations), len(durations)

    def record(self, fingerprint: str, seconds: float) -> None:
        """Add one finished build's duration (a disk that refuses it is logged, nothing more)."""
        with self._lock:
            history = self._load()
            kept = [*history.pop(fingerprint, []), round(float(seconds), 3)][-PER_FINGERPRINT:]
            history[fingerprint] = kept  # re-inserted last: the most recently built
            while len(history) > MAX_FINGERPRINTS:
                del history[next(iter(history))]
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_json(self.path, history)
            except OSError as exc:
                log.warning("engine.build_history.not_written", path=str(self.path), error=str(exc))

    def _load(self) -> dict[str, list[float]]:
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("engine.build_history.unreadable", path=str(self.path), error=str(exc))
            return {}
        if not isinstance(raw, dict):
            return {}
        return {
            str(k): [float(x) for x in v if isinstance(x, int | float)][-PER_FINGERPRINT:]
            for k, v in raw.items()
            if isinstance(v, list)
        }
