"""The running agent's health as :func:`agent.lifecycle.health.unhealthy_because` reads it.

Connected to the broker (the link), frames flowing on each stream (its camera's frame counter
advanced since the previous reading), and slots failing (no model serving after a failed load).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from agent.app.frame_paths import FramePaths
from agent.config import AgentConfig
from agent.lifecycle.health import HealthReading
from agent.mqtt.link import MqttLink
from agent.runtime.slots.slot import ModelSlot


class HealthProbe:
    """Each call is one reading; "flowing" compares each stream's frames with the previous call's."""

    def __init__(
        self,
        config: Callable[[], AgentConfig],
        link: MqttLink,
        frames: FramePaths,
        slots: dict[str, ModelSlot],
    ) -> None:
        self._config = config
        self._link = link
        self._frames = frames
        self._slots = slots
        self._lock = threading.Lock()
        self._counted: dict[str, int] = {}

    def __call__(self) -> HealthReading:
        counts = {name: report.frames for name, report in self._frames.cameras().items()}
        with self._lock:
            flowing = frozenset(name for name, n in counts.items() if n > self._counted.get(name, 0))
            self._counted = counts
        failing = frozenset(
            name for name, slot in self._slots.items() if slot.current is None and slot.failed_loads > 0
        )
        return HealthReading(
            connected=self._link.connected,
            streams_flowing=flowing,
            streams=frozenset(self._config().streams),
            slots_failing=failing,
        )
