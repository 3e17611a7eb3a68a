"""The controller's store of samples for retraining: bounded in count, bytes and per device.

Each ``up/samples`` message (:class:`~agent.protocol.samples.SampleMessage`) is kept as one JSON
document ``{"device": ..., "sample": ...}``. Bounds, all enforced on every add: at most
``per_device`` samples of one device (its oldest goes first, so one device cannot fill the store),
at most ``max_count`` samples and ``max_bytes`` bytes of documents in all (the oldest of any device
goes). :class:`SampleStore` is what both kinds share: the checks, the bounds, a resend kept once.
:class:`FileSampleStore` keeps each document as a file ``state_dir/samples/<seq>-<device>.json``
written temp + fsync + rename, so a reader (the export) sees whole samples only, and a restart reads
the directory back; :class:`~agent.fleet.samples.pg_store.PostgresSampleStore` keeps them as rows of
the controller's database.
"""

from __future__ import annotations

import json
import re
import threading
from abc import ABC, abstractmethod
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
        256 * 1024 * 1024, ge=1024 * 1024, description="Most bytes the samples' documents take in all."
    )
    per_device: int = Field(200, ge=1, le=1_000_000, description="Most samples kept of one device.")


@dataclass(frozen=True)
class StoredSample:
    """One kept sample: its place in the store's order, the device it came from, its document's size."""

    seq: int
    device: str
    size: int


def sample_document(device: str, sample: SampleMessage) -> bytes:
    """What the store keeps of ``sample`` from ``device``."""
    return json.dumps({"device": device, "sample": sample.model_dump(mode="json")}).encode()


def sample_of(document: bytes) -> SampleMessage:
    """The message a stored document holds."""
    return SampleMessage.model_validate(json.loads(document)["sample"])


class SampleStore(ABC):
    """Samples kept within ``bounds``, oldest evicted first (thread-safe); see the module docstring."""

    def __init__(self, bounds: SampleBounds | None = None) -> None:
        self.bounds = bounds or SampleBounds()
        self._lock = threading.Lock()
        #: Samples dropped to stay within the bounds since start (by this store).
        self.evicted = 0
        #: The msg_ids taken since start (at most ``max_count``): a QoS 1 resend is kept once.
        self._seen: OrderedDict[str, None] = OrderedDict()

    def add(self, device: str, sample: SampleMessage) -> StoredSample | None:
        """Keep ``sample`` from ``device`` and evict what the bounds no longer allow, in one step.

        None: the same message was taken already (a QoS 1 resend). ValueError, nothing kept: a
        device id that is not one topic level, or a sample over ``max_bytes`` alone.
        """
        check_level(device, "device id")
        key = f"{device}/{sample.msg_id}"
        data = sample_document(device, sample)
        if len(data) > self.bounds.max_bytes:
            raise ValueError(f"a sample of {len(data)} bytes is over the store's {self.bounds.max_bytes}")
        with self._lock:
            if key in self._seen:
                return None
            kept = self._keep(device, sample.msg_id, data)
            self._seen[key] = None
            if len(self._seen) > self.bounds.max_count:
                self._seen.popitem(last=False)
            if kept is None:
                return None
            stored, evicted = kept
            self.evicted += evicted
            return stored

    @abstractmethod
    def _keep(self, device: str, msg_id: str, data: bytes) -> tuple[StoredSample, int] | None:
        """Store ``data`` and evict, in one step (under the lock): the sample and how many went, or
        None when the store has this message already."""

    @abstractmethod
    def read(self, stored: StoredSample) -> SampleMessage:
        """The sample's message. LookupError: it was evicted since it was listed."""

    def read_all(self) -> Iterator[tuple[StoredSample, SampleMessage]]:
        """Every kept sample with its message, oldest first; one evicted meanwhile is left out."""
        for stored in self.samples():
            try:
                yield stored, self.read(stored)
            except LookupError:
                continue

    @abstractmethod
    def samples(self) -> list[StoredSample]:
        """The kept samples, oldest first."""

    @abstractmethod
    def held_bytes(self) -> int:
        """Bytes the kept samples' documents take."""

    def __iter__(self) -> Iterator[StoredSample]:
        return iter(self.samples())

    @abstractmethod
    def close(self) -> None:
        """Let go of what the store holds open."""


class FileSampleStore(SampleStore):
    """Samples as files under ``directory`` (read back at open)."""

    def __init__(self, directory: Path, bounds: SampleBounds | None = None) -> None:
        super().__init__(bounds)
        self.directory = directory
        self._kept: list[StoredSample] = []
        directory.mkdir(parents=True, exist_ok=True)
        for path in directory.iterdir():
            match = _NAME.match(path.name)
            if match:
                self._kept.append(StoredSample(int(match[1]), match[2], path.stat().st_size))
        self._kept.sort(key=lambda s: s.seq)
        self._next = self._kept[-1].seq + 1 if self._kept else 0

    def _keep(self, device: str, msg_id: str, data: bytes) -> tuple[StoredSample, int] | None:
        mine = [s for s in self._kept if s.device == device]
        doomed = mine[: max(0, len(mine) - self.bounds.per_device + 1)]
        gone = {s.seq for s in doomed}
        rest = [s for s in self._kept if s.seq not in gone]
        total = sum(s.size for s in rest) + len(data)
        while rest and (len(rest) + 1 > self.bounds.max_count or total > self.bounds.max_bytes):
            oldest = rest.pop(0)
            total -= oldest.size
            doomed.append(oldest)
        stored = StoredSample(self._next, device, len(data))
        atomic_write_bytes(self.path_of(stored), data)
        self._next += 1
        for old in doomed:
            self.path_of(old).unlink(missing_ok=True)
        if doomed:
            fsync_directory(self.directory)
        self._kept = [*rest, stored]
        return stored, len(doomed)

    def path_of(self, stored: StoredSample) -> Path:
        """The file ``stored`` is kept in."""
        return self.directory / f"{stored.seq:012d}-{stored.device}.json"

    def read(self, stored: StoredSample) -> SampleMessage:
        try:
            return sample_of(self.path_of(stored).read_bytes())
        except FileNotFoundError as exc:
            raise LookupError(f"sample {stored.seq} of {stored.device} was evicted") from exc

    def samples(self) -> list[StoredSample]:
        with self._lock:
            return list(self._kept)

    def held_bytes(self) -> int:
        with self._lock:
            return sum(s.size for s in self._kept)

    def close(self) -> None:
        return  # every write was a whole file, fsynced: nothing stays open
