"""The per-connection session counter: monotonic across restarts, yet connecting never needs a write.

Each connection attempt takes the next number (the Last Will and the ``online`` status carry it, so a
consumer can tell a stale Last Will from a fresh one: docs/protocol.md). The counter lives in the
spool's key/value table, but not one write per attempt: the spool holds a *reservation*, the highest
number this process may hand out without writing again, set :data:`RESERVATION` ahead. A start begins
above the stored reservation, so numbers stay monotonic across restarts even though most attempts
write nothing. On a full disk the reservation cannot be renewed: the counter goes on in memory
(connecting works), retries the write on every attempt, and warns once. Only a restart after more
than :data:`RESERVATION` attempts without one successful write could repeat a number (at the backoff
cap of 60 s, over 16 hours of a full disk).
"""

from __future__ import annotations

import structlog

from agent.spool.queue import Spool, SpoolWriteError

log = structlog.get_logger(__name__)

#: Spool meta key of the reserved session numbers.
SESSION_KEY = "mqtt.session"
#: Numbers reserved per write. A restart skips what its predecessor reserved but did not use.
RESERVATION = 1000


class SessionCounter:
    """Hands out session numbers; writes the spool only when a reservation runs out, best-effort."""

    def __init__(self, spool: Spool) -> None:
        self._spool = spool
        stored = spool.get_meta(SESSION_KEY)
        self._reserved = int(stored) if stored is not None else 0
        self._last = self._reserved  # numbers up to the stored reservation may have been used
        self._write_failed = False

    def next(self) -> int:
        """The next session number. Never raises for a failed write (the disk may be full)."""
        self._last += 1
        if self._last > self._reserved:
            self._reserve(self._last + RESERVATION - 1)
        return self._last

    def _reserve(self, upto: int) -> None:
        try:
            self._spool.set_meta(SESSION_KEY, str(upto))
        except SpoolWriteError as exc:
            if not self._write_failed:
                self._write_failed = True
                log.warning("mqtt.session.unsaved", session=self._last, error=str(exc))
            return
        if self._write_failed:
            self._write_failed = False
            log.info("mqtt.session.saved", reserved=upto)
        self._reserved = upto
