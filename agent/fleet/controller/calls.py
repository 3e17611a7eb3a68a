"""Running the console's actions on the controller's loop thread, one at a time with the requests.

The console serves from uvicorn's threads; the controller's runners and store writes belong to its
loop. :class:`LoopCall` carries a function to the loop and its result (or error) back;
:class:`ConsoleCalls` is the console's :class:`~agent.fleet.console.app.ConsoleActions` built on it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol


class Controls(Protocol):
    """What ConsoleCalls needs of the controller."""

    def call(self, fn: Callable[[], dict[str, Any]], timeout: float = 30.0) -> dict[str, Any]: ...

    def pause(self, rollout_id: str) -> dict[str, Any]: ...

    def resume(self, rollout_id: str) -> dict[str, Any]: ...

    def abort(self, rollout_id: str, *, rollback: bool) -> dict[str, Any]: ...

    def decommission(self, device: str, *, force: bool = False) -> dict[str, Any]: ...

    def snapshot(self, device: str, stream: str | None) -> dict[str, Any]: ...

    def evidence(self, device: str, job_id: str) -> dict[str, Any]: ...


class LoopCall:
    """A function the loop thread runs for another thread (the console's actions)."""

    def __init__(self, fn: Callable[[], dict[str, Any]]) -> None:
        self._fn = fn
        self._done = threading.Event()
        self._value: dict[str, Any] | None = None
        self._error: BaseException | None = None

    def run(self) -> None:
        try:
            self._value = self._fn()
        except Exception as exc:  # noqa: BLE001 (handed to the caller, which raises it)
            self._error = exc
        self._done.set()

    def result(self, timeout: float) -> dict[str, Any]:
        if not self._done.wait(timeout):
            raise TimeoutError(f"the controller's loop did not answer within {timeout:.0f}s")
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value


class ConsoleCalls:
    """The console's buttons (:class:`~agent.fleet.console.app.ConsoleActions`), run on the loop thread."""

    def __init__(self, controller: Controls) -> None:
        self._controller = controller

    def pause(self, rollout_id: str) -> str:
        status = self._controller.call(lambda: self._controller.pause(rollout_id))
        return f"rollout {rollout_id} {status['state']}"

    def resume(self, rollout_id: str) -> str:
        status = self._controller.call(lambda: self._controller.resume(rollout_id))
        return f"rollout {rollout_id} {status['state']}"

    def abort(self, rollout_id: str, rollback: bool) -> str:
        status = self._controller.call(lambda: self._controller.abort(rollout_id, rollback=rollback))
        return f"rollout {rollout_id} {status['state']}" + (" (rolling back)" if rollback else "")

    def decommission(self, device: str) -> str:
        # Not on the loop: it talks to the broker only, and must not wait behind a rollout's step.
        done = self._controller.decommission(device)
        if not done["cleared"]:
            return f"device {device} forgotten: nothing of it was retained on the broker"
        return f"device {device} decommissioned: {len(done['cleared'])} retained topic(s) cleared"

    def snapshot(self, device: str, stream: str | None) -> dict[str, Any]:
        # Not on the loop either: a round trip to the device, which must not wait behind a rollout.
        return self._controller.snapshot(device, stream)

    def evidence(self, device: str, job_id: str) -> dict[str, Any]:
        # A round trip to the device too: off the loop.
        return self._controller.evidence(device, job_id)
