"""What the device's own targets need of the running agent: its configuration, readings, reload, restart.

The composition root (:mod:`agent.app.root`) supplies each; the targets (``lifecycle/config``, an agent
release) call them from their job's thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from agent.config import AgentConfig
from agent.lifecycle.health import HealthReading


@dataclass(frozen=True)
class RunningAgent:
    """What a target needs of the running agent (the composition root supplies each)."""

    #: The configuration that runs now.
    config: Callable[[], AgentConfig]
    #: The keys of ``new`` a reload cannot apply (they need a restart).
    restart_keys: Callable[[AgentConfig], list[str]]
    #: Reload agent.yaml with its active overlay (as SIGHUP does); returns once it was applied.
    reload: Callable[[], None]
    #: Stop the agent to be started again (exit code
    #: :data:`~agent.lifecycle.restart.RESTART_EXIT_CODE`); returns at once.
    restart: Callable[[], None]
    health: Callable[[], HealthReading]
    #: Set once the agent started (its streams and slots run).
    started: threading.Event
    #: What a target reports changed (``up/info`` is republished).
    changed: Callable[[], None] = lambda: None
