"""The desired states an import handed to the agent: kept under ``{state_dir}/imported/`` like retained
messages, one file per target plus the root chain, and offered to the agent at every start and when
``edge-agent import`` signals it (SIGUSR1).

Kept, not consumed: a restart in the middle of an imported job finds its desired state again, as a
reconnect finds a retained one, and the job runner resumes or ignores it by the same rules (one job
id runs once). A newer import replaces a target's file; what the broker sends later is judged by the
job runner's sequence rule as usual.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import structlog

from agent.fsutil import atomic_write_bytes, fsync_directory
from agent.protocol.topics import Topics, trust_root

log = structlog.get_logger(__name__)

INBOX_DIR = "imported"
_ROOT_FILE = "root.json"
_DESIRED_DIR = "desired"


@dataclass(frozen=True)
class ImportedMessage:
    """One kept payload and the topic it stands for."""

    topic: str
    payload: bytes


class ImportedStates:
    """``{state_dir}/imported/``: written by ``edge-agent import``, read by the agent."""

    def __init__(self, state_dir: Path) -> None:
        self.root = Path(state_dir) / INBOX_DIR

    def keep(self, root_chain: bytes | None, desired: dict[str, bytes]) -> None:
        """Keep ``root_chain`` and each target's desired state (temp + fsync + rename each)."""
        folder = self.root / _DESIRED_DIR
        folder.mkdir(parents=True, exist_ok=True)
        if root_chain is not None:
            atomic_write_bytes(self.root / _ROOT_FILE, root_chain)
        for target, payload in desired.items():
            atomic_write_bytes(folder / target, payload)
        fsync_directory(folder)

    def messages(self, topics: Topics) -> list[ImportedMessage]:
        """What to hand to the agent, the root chain first (a desired state may need its newer root)."""
        found: list[ImportedMessage] = []
        chain = self.root / _ROOT_FILE
        try:
            if chain.is_file():
                found.append(ImportedMessage(trust_root(topics.prefix), chain.read_bytes()))
            folder = self.root / _DESIRED_DIR
            targets = (
                sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
                if folder.is_dir()
                else []
            )
            found.extend(ImportedMessage(topics.desired(path.name), path.read_bytes()) for path in targets)
        except (OSError, ValueError) as exc:
            log.error("bundle.inbox.unreadable", path=str(self.root), error=str(exc))
        return found
