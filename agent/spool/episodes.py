"""What the spool tells of itself: its figures (rows, bytes, what it dropped and why) and its two
episodes, at the cap and writes failing, each logged once when it starts and once when it ends.

One job (the spool's telemetry and journal lines); :class:`~agent.spool.queue.Spool` changes them under
its lock, after the transaction they describe, and decides what is stored and dropped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import structlog

from agent.spool.settings import SpoolSettings

log = structlog.get_logger(__name__)

#: Free bytes on the spool's disk that end a write-failure episode (with a write that succeeds): a disk
#: hovering at full, where writes fail and succeed by turns, stays one episode with one warning.
WRITE_RECOVERED_FREE_BYTES = 1024 * 1024


@dataclass
class SpoolCounts:
    """The spool's figures: what it holds, and what it did not keep."""

    rows: int = 0
    bytes: int = 0
    evicted: int = 0  # results deleted at the cap to make room (drop_oldest)
    dropped_at_cap: int = 0  # new results refused at the cap
    expired: int = 0  # results deleted past their time-to-live
    dropped_write_failed: int = 0  # results not stored because the write failed (disk full)
    write_failed_raised: int = (
        0  # not stored, handed back to the caller (SpoolWriteError): job states, results while connected
    )


class SpoolEpisodes:
    """The figures and episodes of the spool at ``path`` (not thread-safe: the spool's lock guards it)."""

    def __init__(self, path: Path, settings: SpoolSettings) -> None:
        self.path = path
        self.settings = settings
        self.n = SpoolCounts()
        self._at_cap = False  # inside a cap episode (logged once when it starts and once when it ends)
        self._write_error: str | None = None  # inside a write-failure episode (same)

    # -- the cap ------------------------------------------------------------------------------

    def cap_reached(self) -> None:
        """Results were evicted or refused at the cap: the episode starts, if it has not."""
        if not self._at_cap:
            self._at_cap = True
            log.warning(
                "spool.cap.reached",
                rows=self.n.rows,
                bytes=self.n.bytes,
                max_rows=self.settings.max_rows,
                max_bytes=self.settings.max_bytes,
                policy=self.settings.results_at_cap,
            )

    def note_level(self) -> None:
        """Rows were deleted: the cap episode ends once the replay has made real room."""
        # The episode ends when the replay has made real room (10 % below both caps), so a spool
        # hovering at the cap logs one warning, not one per batch.
        s = self.settings
        if self._at_cap and self.n.rows <= 0.9 * s.max_rows and self.n.bytes <= 0.9 * s.max_bytes:
            self._at_cap = False
            log.info(
                "spool.cap.cleared",
                rows=self.n.rows,
                evicted=self.n.evicted,
                dropped_at_cap=self.n.dropped_at_cap,
            )

    # -- failed writes ------------------------------------------------------------------------

    @property
    def write_failing(self) -> bool:
        """Inside a write-failure episode."""
        return self._write_error is not None

    def write_failed(self, error: str, **fields: str) -> None:
        """A write failed: the episode starts, if it has not (one warning: a full disk with the broker
        down would otherwise log per frame)."""
        if self._write_error is None:
            self._write_error = error
            log.warning("spool.write.failed", path=str(self.path), error=error, **fields)

    def write_succeeded(self) -> None:
        """A write went through: the episode ends if the disk has room again (:meth:`_space_is_back`)."""
        if self._write_error is not None and self._space_is_back():
            log.info(
                "spool.write.recovered",
                path=str(self.path),
                dropped_write_failed=self.n.dropped_write_failed,
            )
            self._write_error = None

    def _space_is_back(self) -> bool:
        """True when the spool's disk has :data:`WRITE_RECOVERED_FREE_BYTES` free: the end of a
        write-failure episode. A write that squeezed into the last free pages does not end it: the
        next one fails again, and one episode must not log two warnings."""
        try:
            st = os.statvfs(self.path.parent)
        except OSError:
            return True  # cannot tell: the write went through, take it as the end
        return st.f_bavail * st.f_frsize >= WRITE_RECOVERED_FREE_BYTES

    # -- telemetry ----------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """``rows``, ``bytes``, their caps, the drop counters and ``write_failing`` (0/1)."""
        n = self.n
        return {
            "rows": float(n.rows),
            "bytes": float(n.bytes),
            "max_rows": float(self.settings.max_rows),
            "max_bytes": float(self.settings.max_bytes),
            "evicted": float(n.evicted),
            "dropped_at_cap": float(n.dropped_at_cap),
            "expired": float(n.expired),
            "dropped_write_failed": float(n.dropped_write_failed),
            "write_failed_raised": float(n.write_failed_raised),
            "write_failing": 1.0 if self.write_failing else 0.0,
        }
