"""The chunk server's work: chunks devices asked for and not yet sent, merged per device and model.

Why merge instead of answering requests in arrival order: when a wave starts, hundreds of devices ask
for the whole model at once and the server sends it to them one after another. A device near the
back of that line waits longer than its chunk timeout, asks again, and again (its timeout doubles
each time) before its first chunk leaves. Answered in arrival order every one of those requests is
served in full: at 1,000 simulated devices the server sent each device its model about five times
over, and the copies that arrived after the device had finished were thrown away (docs/fleet.md,
"Measured at fleet scale"). Merged, a request for chunks that are still waiting adds nothing, and its
place in the line is the first request's.

The first request's correlation data is kept too: the device matches a reply to the request it
answers, so its round-trip sample is the whole wait, and its timeout grows to match
(agent/delivery/transfer/rto.py) instead of firing again while the chunks are on their way.

Pure: no MQTT here. The :class:`~agent.fleet.chunks.server.ChunkServer` adds what its dispatcher thread
accepted and sends what its sender thread takes.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field

#: Most (device, model, chunk size) entries waiting at once: a bound on memory whatever devices send.
DEFAULT_MAX_ENTRIES = 65536
#: Most entries walked to find a request's place in the line (a bound on the dispatcher's work).
_AHEAD_WALK = 4096


@dataclass
class PendingChunks:
    """The chunks of one model one device waits for, in the order it asked for them."""

    device: str
    sha256: str
    chunk_size: int
    #: The first waiting request's correlation data (the device's round trip then spans the whole wait).
    correlation: bytes | None
    #: Chunk indices, an insertion-ordered set.
    indices: dict[int, None] = field(default_factory=dict)


class ChunkQueue:
    """Entries served first come, first served; a request merges into its device's waiting entry.

    Thread-safe: :meth:`add` from the MQTT dispatcher, :meth:`take` from the sender thread.
    """

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[tuple[str, str, int], PendingChunks] = (
            collections.OrderedDict()
        )
        self._cond = threading.Condition()
        self._closed = False
        self._waiting = 0  # chunks in all entries

    def add(
        self,
        *,
        device: str,
        sha256: str,
        chunk_size: int,
        correlation: bytes | None,
        indices: list[int],
    ) -> int | None:
        """Queue ``indices`` for ``device``; how many were not waiting already (None: full or closed)."""
        key = (device, sha256, chunk_size)
        with self._cond:
            entry = self._entries.get(key)
            if entry is None:
                if self._closed or len(self._entries) >= self.max_entries:
                    return None
                entry = PendingChunks(device, sha256, chunk_size, correlation)
                self._entries[key] = entry
            before = len(entry.indices)
            entry.indices.update(dict.fromkeys(indices))
            added = len(entry.indices) - before
            self._waiting += added
            self._cond.notify()
            return added

    def ahead(self, *, device: str, sha256: str, chunk_size: int) -> tuple[int, int]:
        """Chunks waiting in entries before this entry, and in it; ``(0, 0)`` when it waits no more."""
        key = (device, sha256, chunk_size)
        with self._cond:
            entry = self._entries.get(key)
            if entry is None:
                return 0, 0
            own = len(entry.indices)
            if next(reversed(self._entries)) == key:  # the usual case: a new entry at the back
                return self._waiting - own, own
            before = 0
            for walked, (other_key, other) in enumerate(self._entries.items()):
                if other_key == key:
                    return before, own
                if walked >= _AHEAD_WALK:
                    break
                before += len(other.indices)
            # Deep in a very long line: say everything waits ahead (a longer wait is the safe error).
            return self._waiting - own, own

    def take(self, timeout: float) -> PendingChunks | None:
        """The entry waiting longest, removed from the queue; None after ``timeout`` s or once closed.

        A request arriving while its entry is being sent starts a new entry at the back of the line.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._entries) or self._closed, timeout):
                return None
            if self._closed:
                return None
            _key, entry = self._entries.popitem(last=False)
            self._waiting -= len(entry.indices)
            return entry

    def close(self) -> None:
        """Wake :meth:`take` for good (what is waiting is dropped: the devices ask again)."""
        with self._cond:
            self._closed = True
            self._entries.clear()
            self._waiting = 0
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._entries)

    @property
    def waiting_chunks(self) -> int:
        """Chunks waiting in all entries."""
        with self._cond:
            return self._waiting
