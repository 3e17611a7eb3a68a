"""bench/controller_scale.py runs its broker as the project ships it: the same ``max_queued_messages``.

With mosquitto's own default (1,000) a controller that subscribes gets the retained status and info
of only about a thousand devices, and a 10,000-device run measures a tenth of the fleet.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def _bench() -> ModuleType:
    """The script loaded from its file (bench/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(
        "bench_controller_scale", REPO / "bench" / "controller_scale.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_bench_broker_queues_as_many_messages_as_the_shipped_broker_config() -> None:
    shipped = re.search(
        r"^max_queued_messages\s+(\d+)\s*$",
        (REPO / "configs" / "mosquitto" / "mosquitto.conf").read_text(),
        re.M,
    )
    assert shipped is not None, "configs/mosquitto/mosquitto.conf no longer sets max_queued_messages"
    assert int(shipped.group(1)) == _bench().SHIPPED_BROKER_QUEUE
