"""The wake-up socket pair of paho's loop, coalesced: at most one wake byte per turn of the loop.

Used by :class:`agent.mqtt.core.MqttCore` for a user that runs paho's loop on its own thread (the
device link). It pokes paho's private attributes but needs no paho import.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any


class CoalescedWake:
    """paho's socket-pair write end, writing at most one wake byte per turn of our network loop.

    paho's ``publish()`` from another thread appends the packet to its queue, then writes a byte here
    to break the loop out of ``select()``. One byte already waiting wakes the loop just as well, so
    the next ones are skipped until :meth:`rearm`, called by the network thread before every
    ``loop()``; the loop's own thread writes none (a PUBACK it queues while reading a message goes
    out on its next turn, which selects for writing). Nothing is lost: a publisher that skips its
    byte appended its packet before it looked at the flag, so before the rearm, so before ``loop()``
    checks ``want_write()`` and selects on the socket for writing. paho keeps the pair in private
    attributes (paho 2.x: ``_sockpairW``, recreated on reconnect); tests/mqtt/test_link.py checks
    that a lone publish still wakes the loop.
    """

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self.pending = False
        #: The thread that runs the loop (the last to rearm): a packet it queues itself needs no
        #: wake, since its next ``loop()`` selects for writing whenever paho has something to write.
        self.loop_thread: int | None = None

    def send(self, data: bytes) -> int:
        if self.pending or threading.get_ident() == self.loop_thread:
            return len(data)
        self.pending = True
        sent: int = self._sock.send(data)  # BlockingIOError (buffer full of wake bytes): paho ignores it
        return sent

    def close(self) -> None:
        self._sock.close()

    @staticmethod
    def wake_now(client: Any) -> None:
        """Break the loop out of ``select()`` now, pending byte or not (stop must not wait a turn)."""
        wake = getattr(client, "_sockpairW", None)
        sock = wake._sock if isinstance(wake, CoalescedWake) else wake
        if sock is not None:
            with contextlib.suppress(OSError):  # full (a wake is pending anyway) or already closed
                sock.send(b"\0")

    @staticmethod
    def wake(client: Any) -> None:
        """Break the loop out of ``select()``: one wake byte per turn, like paho's own publishes."""
        wake = getattr(client, "_sockpairW", None)
        if wake is not None:
            with contextlib.suppress(OSError):  # full (a wake is pending anyway) or already closed
                wake.send(b"\0")

    @classmethod
    def rearm(cls, client: Any) -> None:
        """Wrap paho's current write end (once per socket pair) and allow the next wake byte."""
        wake = getattr(client, "_sockpairW", None)
        if wake is None:
            return  # paho makes a new pair inside loop(); wrapped on the next turn
        if not isinstance(wake, cls):
            wake = cls(wake)
            client._sockpairW = wake
        wake.pending = False
        wake.loop_thread = threading.get_ident()
