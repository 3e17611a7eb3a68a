"""Fixtures for link tests: a factory of MqttLinks (stopped at teardown) with fast reconnects."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.demo.broker import Broker
from agent.mqtt.link import MqttLink
from agent.mqtt.settings import MqttSettings
from agent.spool.queue import Spool

LinkFactory = Callable[..., MqttLink]


def fast_settings(broker: Broker | None, **overrides: Any) -> MqttSettings:
    """Settings for tests: the given broker (None: pass ``port``), quick reconnects."""
    values: dict[str, Any] = {
        "host": broker.host if broker else "127.0.0.1",
        "port": broker.port if broker else 1,
        "reconnect_min_s": 0.05,
        "reconnect_max_s": 0.3,
        "keepalive_s": 5,
    }
    values.update(overrides)
    return MqttSettings(**values)


@pytest.fixture
def device_id() -> str:
    """A device id unique to the test, so tests sharing a broker never see each other's messages."""
    return f"dev-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def make_link(tmp_path: Path) -> Iterator[LinkFactory]:
    """``make_link(settings, client_id=..., spool=None, status_topic=None, on_connected=None)``.

    Not started. A spool at ``tmp_path/<client_id>.sqlite`` is made unless given. Stopped at teardown.
    """
    links: list[MqttLink] = []
    spools: list[Spool] = []

    def make(
        settings: MqttSettings,
        *,
        client_id: str,
        spool: Spool | None = None,
        status_topic: str | None = None,
        on_connected: Callable[[int], None] | None = None,
    ) -> MqttLink:
        if spool is None:
            spool = Spool(tmp_path / f"{client_id}.sqlite")
            spools.append(spool)
        link = MqttLink(
            settings,
            client_id=client_id,
            status_topic=status_topic or f"{settings.prefix}/{client_id}/up/status",
            agent_version="0.0.test",
            spool=spool,
            on_connected=on_connected,
        )
        links.append(link)
        return link

    yield make
    for link in links:
        link.stop(timeout=1.0)
    for spool in spools:
        spool.close()
