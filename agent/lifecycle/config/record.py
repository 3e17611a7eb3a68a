"""What the device keeps of its configuration overlay under ``{state_dir}/config/``, written atomically.

``state.json`` says which overlay runs (``active``), which one was last confirmed healthy
(``last_good``), which change is being applied or watched (``pending``, with the health reading
taken before it) and why the last change was put back (``reverted``). The overlays themselves are
``overlays/<sha256>.yaml`` (the delivered document with its sealed values replaced by the secret
files' paths) and the opened secrets ``secrets/<sha256>/<key path>`` (0600). Every file is written
before ``state.json`` names it, so one rename of ``state.json`` switches what the next start loads:
a kill at any moment leaves the old overlay or the new one, and the record says which.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import structlog
import yaml
from pydantic import Field, ValidationError

from agent.errors import ConfigError
from agent.fsutil import atomic_write_bytes, atomic_write_json
from agent.lifecycle.health import HealthReading
from agent.model_base import StrictModel

log = structlog.get_logger(__name__)

#: Mode of every file that holds an opened secret.
SECRET_FILE_MODE = 0o600


class OverlayRef(StrictModel):
    """One delivered overlay: its version, the job that brought it, the document's SHA-256."""

    version: str
    job_id: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Reading(StrictModel):
    """A :class:`~agent.lifecycle.health.HealthReading` as kept on disk (a probation outlives a restart)."""

    connected: bool
    streams_flowing: list[str]
    streams: list[str]
    slots_failing: list[str]

    @classmethod
    def of(cls, reading: HealthReading) -> Reading:
        return cls(
            connected=reading.connected,
            streams_flowing=sorted(reading.streams_flowing),
            streams=sorted(reading.streams),
            slots_failing=sorted(reading.slots_failing),
        )

    def health(self) -> HealthReading:
        return HealthReading(
            connected=self.connected,
            streams_flowing=frozenset(self.streams_flowing),
            streams=frozenset(self.streams),
            slots_failing=frozenset(self.slots_failing),
        )


class PendingChange(StrictModel):
    """The change being applied or watched: ``active`` is already the new overlay."""

    overlay: OverlayRef
    #: The change needed a restart (the revert may too).
    restart: bool
    before: Reading
    #: Starts of the agent with this change pending: a change the agent cannot start with is put back.
    starts: int = 0


class Reverted(StrictModel):
    """The last change that was put back, and why."""

    job_id: str
    version: str
    reason: str = Field(max_length=300)


class ConfigRecord(StrictModel):
    """``state.json``: what runs, what was last confirmed, what is being tried, what was put back."""

    active: OverlayRef | None = None
    last_good: OverlayRef | None = None
    pending: PendingChange | None = None
    reverted: Reverted | None = None


class OverlayFiles:
    """``{state_dir}/config/``: the record, the overlays by SHA-256 and their opened secrets."""

    def __init__(self, state_dir: Path) -> None:
        self.root = state_dir / "config"
        self.record_path = self.root / "state.json"
        self.overlays = self.root / "overlays"
        self.secrets = self.root / "secrets"

    def read(self) -> ConfigRecord:
        """The record; an empty one when there is none (or it is unreadable: the base file alone runs)."""
        try:
            return ConfigRecord.model_validate_json(self.record_path.read_bytes())
        except FileNotFoundError:
            return ConfigRecord()
        except (OSError, ValidationError) as exc:
            log.error("config.overlay.record_unreadable", path=str(self.record_path), error=str(exc))
            return ConfigRecord()

    def write(self, record: ConfigRecord) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.record_path, record.model_dump(mode="json"))

    def overlay_path(self, sha256: str) -> Path:
        return self.overlays / f"{sha256}.yaml"

    def has_overlay(self, sha256: str) -> bool:
        return self.overlay_path(sha256).is_file()

    def write_overlay(self, sha256: str, overlay: dict[str, Any]) -> None:
        self.overlays.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.overlay_path(sha256), yaml.safe_dump(overlay, sort_keys=True).encode())

    def load_overlay(self, ref: OverlayRef | None) -> dict[str, Any]:
        """The stored overlay of ``ref`` ({} for none); ConfigError when it cannot be read."""
        if ref is None:
            return {}
        path = self.overlay_path(ref.sha256)
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise ConfigError(
                f"overlay {ref.version}: cannot read {path}: {exc}", problems=[str(exc)]
            ) from exc
        return data if isinstance(data, dict) else {}

    def secret_path(self, sha256: str, key_path: str) -> Path:
        return self.secrets / sha256 / key_path

    def write_secret(self, sha256: str, key_path: str, value: bytes) -> Path:
        path = self.secret_path(sha256, key_path)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write_bytes(path, value, mode=SECRET_FILE_MODE)
        return path

    def collect(self, record: ConfigRecord) -> None:
        """Remove overlays and secrets no longer named by ``record`` (after a change ended)."""
        keep = {
            ref.sha256
            for ref in (record.active, record.last_good, record.pending.overlay if record.pending else None)
            if ref is not None
        }
        for path in self.overlays.glob("*.yaml") if self.overlays.is_dir() else ():
            if path.stem not in keep:
                path.unlink(missing_ok=True)
        for path in self.secrets.iterdir() if self.secrets.is_dir() else ():
            if path.name not in keep:
                shutil.rmtree(path, ignore_errors=True)
