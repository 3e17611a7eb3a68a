"""The controller's store of samples for retraining: bounded in count, bytes and per device.

Each ``up/samples`` message (:class:`~agent.protocol.samples.SampleMessage`) is one file
``state_dir/samples/<seq>-<device>.json`` written temp + fsync + rename, so a reader (the export)
sees whole samples only. Bounds, all enforced on every add: at most ``per_device`` samples of one
device (its oldest goes first, so one device cannot fill the store), at most ``max_count`` samples
and ``max_bytes`` bytes in all (the oldest of any device goes). A restart reads the directory back.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field

from agent.fsutil import atomic_write_bytes, fsync_directory
from agent.model_base import StrictModel
from agent.protocol.samples import SampleMessage
from agent.protocol.topics import check_level

_NAME = re.compile(r"^(\d{12})-(.+)\.json$")


class SampleBounds(StrictModel):
    """How many samples the controller keeps (``samples:`` in controller.yaml)."""

    max_count: int = Field(2000, ge=1, le=1_000_000, description="Most samples kept in all.")
    max_bytes: int = Field(
        256 * 1024 * 1024, ge=1024 * 1024, description="Most bytes the samples take on disk in all."
    )
    per_device: int = Field(200, ge=1, le=1_000_000, description="Most samples kept of one device.")


@dataclass(frozen=True)
class StoredSample:
    """One kept sample: its file, the device it came from and its size on disk."""

    seq: int
    device: str
    path: Path
    size: int

    def read(self) -> SampleMessage:
        """The sample's message, read back from its file."""
        return SampleMessage.model_validate(json.loads(self.path.read_bytes())["sample"])


class SampleStore:
    """Samples on disk under ``directory``, oldest evicted past the bounds (thread-safe)."""

    def __init__(self, directory: Path, bounds: SampleBounds | None = None) -> None:
        self.directory = directory
        self.bounds = bounds or SampleBounds()
        self._lock = threading.Lock()
        self._kept: list[StoredSample] = []
        #: Samples dropped to stay within the bounds since start.
        self.evicted = 0
        #: The msg_ids taken since start (at most ``max_count``): a QoS 1 resend is kept once.
        self._seen: OrderedDict[str, None] = OrderedDict()
        directory.mkdir(parents=True, exist_ok=True)
        for path in directory.iterdir():
            match = _NAME.match(path.name)
            if match:
                self._kept.append(StoredSample(int(match[1]), match[2], path, path.stat().st_size))
        self._kept.sort(key=lambda s: s.seq)
        self._next = self._kept[-1].seq + 1 if self._kept else 0

    def add(self, device: str, sample: SampleMessage) -> StoredSample | None:
        """Write ``sample`` from ``device`` and evict what the bounds no longer allow.

        None: the same message was taken already (a QoS 1 resend).
        """
        check_level(device, "device id")
        key = f"{device}/{sample.msg_id}"
        data = json.dumps({"device": device, "sample": sample.model_dump(mode="json")}).encode()
        if len(data) > self.bounds.max_bytes:
            raise ValueError(f"a sample of {len(data)} bytes is over the store's {self.bounds.max_bytes}")
        with self._lock:
            if key in self._seen:
                return None
            self._seen[key] = None
            if len(self._seen) > self.bounds.max_count:
                self._seen.popitem(last=False)
            mine = [s for s in self._kept if s.device == device]
            doomed = mine[: max(0, len(mine) - self.bounds.per_device + 1)]
            gone = {s.seq for s in doomed}
            rest = [s for s in self._kept if s.seq not in gone]
            total = sum(s.size for s in rest) + len(data)
            while rest and (len(rest) + 1 > self.bounds.max_count or total > self.bounds.max_bytes):
                oldest = rest.pop(0)
                total -= oldest.size
                doomed.append(oldest)
            path = self.directory / f"{self._next:012d}-{device}.json"
            atomic_write_bytes(path, data)
            stored = StoredSample(self._next, device, path, len(data))
            self._next += 1
            for old in doomed:
                old.path.unlink(missing_ok=True)
            if doomed:
                fsync_directory(self.directory)
            self.evicted += len(doomed)
            self._kept = [*rest, stored]
            return stored

    def samples(self) -> list[StoredSample]:
        """The kept samples, oldest first."""
        with self._lock:
            return list(self._kept)

    def held_bytes(self) -> int:
        """Bytes the kept samples take on disk."""
        with self._lock:
            return sum(s.size for s in self._kept)

    def __iter__(self) -> Iterator[StoredSample]:
        return iter(self.samples())
