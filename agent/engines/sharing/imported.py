"""Shared engines carried in by ``edge-agent import`` (docs/bundles.md): the controller's signed
records and their files, kept under ``{state_dir}/imported-engines/``, where the engine cache's
second level looks before it asks the fleet.

They are kept as they came: when a build needs one's key, the record is checked exactly as one
received over MQTT (:mod:`.trust`), and each file against the record's signed SHA-256 as it is
copied into the cache, so a file changed on the device after the import is refused too.
"""

from __future__ import annotations

import re
import shutil
import threading
from collections.abc import Iterable
from pathlib import Path

import structlog
from pydantic import ValidationError

from agent.errors import AgentError
from agent.fsutil import atomic_write_bytes, fsync_directory, sha256_file
from agent.protocol.engines import MAX_META_CHARS, EngineFile, EngineRecord, SignedEngine
from agent.store import ModelStore

log = structlog.get_logger(__name__)

IMPORTED_ENGINES_DIR = "imported-engines"
_FILES_DIR = "files"
_KEY = re.compile(r"^[0-9a-f]{64}$")
#: Largest kept record read back (a signed record is bounded by the protocol).
_MAX_RECORD_BYTES = 4 * MAX_META_CHARS + 4096


class ImportedEngines:
    """``{state_dir}/imported-engines/``: ``<key>.json`` (a :class:`SignedEngine`) and ``files/``
    (each file once by SHA-256). Written by ``edge-agent import``, read by the running agent."""

    def __init__(self, state_dir: Path) -> None:
        self.root = Path(state_dir) / IMPORTED_ENGINES_DIR
        self.files = ModelStore(self.root / _FILES_DIR)

    def _record_path(self, key: str) -> Path:
        if not _KEY.match(key):  # a cache key is a SHA-256: never a path a record chooses
            raise ValueError(f"not an engine cache key: {key[:80]!r}")
        return self.root / f"{key}.json"

    def keep(self, engines: Iterable[tuple[EngineRecord, SignedEngine]]) -> None:
        """Keep each signed record under its key (temp + fsync + rename each); its files are in
        :attr:`files` already."""
        self.root.mkdir(parents=True, exist_ok=True)
        for record, signed in engines:
            atomic_write_bytes(self._record_path(record.key), signed.model_dump_json().encode())
        fsync_directory(self.root)

    def signed(self, key: str) -> SignedEngine | None:
        """The kept record for ``key``, not yet checked (None: none kept, or unreadable)."""
        path = self._record_path(key)
        try:
            with open(path, "rb") as f:
                data = f.read(_MAX_RECORD_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("engine.imported.unreadable", path=str(path), error=str(exc)[:300])
            return None
        if len(data) > _MAX_RECORD_BYTES:
            log.warning("engine.imported.unreadable", path=str(path), error="larger than its bound")
            return None
        try:
            return SignedEngine.model_validate_json(data)
        except ValidationError as exc:
            log.warning("engine.imported.unreadable", path=str(path), error=str(exc)[:300])
            return None

    def copy(self, file: EngineFile, directory: Path, cancel: threading.Event | None = None) -> Path:
        """``file`` copied into ``directory`` and checked against its signed SHA-256 (the same
        signature as the fleet download, which the cache's second level takes it in place of)."""
        source = self.files.path_for(file.sha256)
        if not source.is_file():
            raise AgentError(
                f"the imported engine's file {file.name} ({file.sha256[:12]}) is not on this device"
            )
        target = directory / file.name
        shutil.copyfile(source, target)
        actual = sha256_file(target)
        if actual != file.sha256:
            raise AgentError(
                f"the imported engine's file {file.name} hashes to {actual[:12]}, "
                f"not the signed {file.sha256[:12]}"
            )
        return target
