"""What a rollout of one of the device's own targets delivers: the document (a configuration overlay,
an agent release), its version and hash, an agent release's wheels, and its watch window."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.errors import ConfigError
from agent.fleet.deploy.agent_release import read_release_dir
from agent.fleet.deploy.overlay import read_overlay
from agent.fleet.deploy.plan import TARGET_DOCUMENT_NAMES, TARGET_MODEL_IDS, TARGET_PROBATION_S
from agent.fsutil import sha256_file
from agent.protocol.device_targets import AGENT_TARGET, CONFIG_TARGET


@dataclass(frozen=True)
class TargetDocument:
    """What a target rollout delivers: the document's file and fields, an agent release's wheels."""

    target: str
    path: Path
    version: str
    sha256: str
    probation_s: float
    #: An agent release's wheels: (file name, path, SHA-256).
    wheels: tuple[tuple[str, Path, str], ...] = ()
    #: The document's signed release, when the command signed one.
    release: str | None = None

    @classmethod
    def overlay_file(cls, path: Path, version: str) -> TargetDocument:
        """The overlay file at ``path`` as version ``version`` (ConfigError when no device takes it)."""
        read_overlay(path)
        return cls(CONFIG_TARGET, path, version, sha256_file(path), TARGET_PROBATION_S[CONFIG_TARGET])

    @classmethod
    def agent_release_dir(cls, path: Path, version: str | None) -> TargetDocument:
        """The release directory ``path``, its wheels checked (ConfigError naming what differs)."""
        release_dir = read_release_dir(path)
        release = release_dir.release
        if version and version != release.version:
            raise ConfigError(f"--version {version}: the agent release in {path} is {release.version}")
        hashes = {w.filename: w.sha256 for w in release.wheels}
        return cls(
            AGENT_TARGET,
            release_dir.document,
            release.version,
            sha256_file(release_dir.document),
            TARGET_PROBATION_S[AGENT_TARGET],
            tuple((name, p, hashes[name]) for name, p in release_dir.wheels),
        )

    def request_fields(self) -> dict[str, Any]:
        """The :class:`~agent.fleet.rollout.spec.RolloutRequest` fields that name this document."""
        return {
            "slot": self.target,
            "model_sha256": self.sha256,
            "model_name": TARGET_DOCUMENT_NAMES[self.target],
            "model_id": TARGET_MODEL_IDS[self.target],
            "version": self.version,
            "wheels": [{"name": n, "sha256": s} for n, _, s in self.wheels] or None,
        }
