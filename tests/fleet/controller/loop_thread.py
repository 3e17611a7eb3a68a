"""An in-process controller whose loop runs on a thread of the test (no tests here)."""

from __future__ import annotations

import threading

from agent.fleet.controller.config import ControllerConfig
from agent.fleet.controller.process import FleetController
from tests.waiting import patient


class RunningController:
    """A started FleetController, ``run`` on a daemon thread.

    ``catch``: what the loop may raise that the test wants to look at (kept in ``raised``); anything
    else goes to the thread's excepthook, where pytest reports it."""

    def __init__(self, config: ControllerConfig, catch: type[BaseException] | None = None) -> None:
        self.controller = FleetController(config).start()
        self.catch = catch
        self.raised: list[BaseException] = []
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.controller.run(self.stop_event)
        except BaseException as exc:
            if self.catch is None or not isinstance(exc, self.catch):
                raise
            self.raised.append(exc)

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(patient(10))
        self.controller.stop()
