"""Which blocking call a thread is inside right now, and for how long: what the watchdog reads.

A loop that refreshes a heartbeat between calls cannot tell "idle" from "stuck inside a call":
while the call hangs nothing refreshes anything, but a sibling thread (an idle poll, a second
inference worker) may keep the heartbeat fresh. So the frame path marks each call that can
hang (a camera driver's open/read/close, a model's inference) with a :class:`CallWatch`, and the
watchdog asks every watch how long its current call has been running. Stdlib only, so camera
sources and the runtime can both use it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class OpenCall:
    """A call in progress: what it is and how many seconds it has been running."""

    what: str
    seconds: float


class CallWatch:
    """The call one thread is in now (``enter`` before it, ``leave`` after it, in ``finally``).

    One thread enters and leaves; any thread may read :meth:`current`. The state is a single
    attribute holding a tuple, replaced whole, so a reader never sees a name from one call with
    the start time of another, and no lock sits on the frame path.
    """

    __slots__ = ("_call",)

    def __init__(self) -> None:
        self._call: tuple[str, float] | None = None

    def enter(self, what: str) -> None:
        """A call named ``what`` starts now."""
        self._call = (what, time.monotonic())

    def leave(self) -> None:
        """The call returned (or raised)."""
        self._call = None

    def current(self) -> OpenCall | None:
        """The call in progress, or None between calls."""
        call = self._call
        if call is None:
            return None
        return OpenCall(call[0], time.monotonic() - call[1])

    def over(self, bound_s: float) -> OpenCall | None:
        """The call in progress if it has been running for longer than ``bound_s``, else None."""
        call = self.current()
        return call if call is not None and call.seconds > bound_s else None
