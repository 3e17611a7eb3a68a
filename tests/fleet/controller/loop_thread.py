"""An in-process controller's loop on a thread of the test, keeping what it raised (no tests here)."""

from __future__ import annotations

import threading

from agent.fleet.controller.process import FleetController


class LoopThread:
    """``controller.run(stop)`` on a daemon thread; what it raises of ``catch`` lands in ``raised``."""

    def __init__(self, controller: FleetController, catch: type[BaseException] = BaseException) -> None:
        self.controller = controller
        self.catch = catch
        self.stop = threading.Event()
        self.raised: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.controller.run(self.stop)
        except BaseException as exc:
            if not isinstance(exc, self.catch):
                raise
            self.raised.append(exc)

    def end(self) -> None:
        """Stop the loop, wait for it a bounded time, stop the controller."""
        self.stop.set()
        self.thread.join(10)
        self.controller.stop()
