"""What `fleet bundle` reads back from a real broker: each device's retained desired states and the
root chain, exactly as published, and each device's retained up/info (its platform picks the shared
engines carried); a device with no desired state is named."""

from __future__ import annotations

import uuid

import pytest

from agent.demo.broker import Broker
from agent.errors import UsageError
from agent.fleet.bundle.retained import read_published
from agent.mqtt.service_client import ServiceClient
from agent.protocol.topics import Topics, trust_root
from tests.e2e.fleet_rig import operator_settings
from tests.waiting import patient


def test_the_retained_desired_states_and_root_chain_are_read_back_exactly(broker: Broker) -> None:
    prefix = f"bundle-{uuid.uuid4().hex[:6]}/v1"
    settings = operator_settings(broker).model_copy(update={"prefix": prefix})
    client = ServiceClient(settings)
    client.start(patient(10))
    try:
        client.publish(Topics(prefix, "cam-a").desired("cls"), b'{"manifest": "a"}', qos=1, retain=True)
        client.publish(Topics(prefix, "cam-a").desired("_config"), b'{"manifest": "c"}', qos=1, retain=True)
        client.publish(Topics(prefix, "cam-b").desired("cls"), b'{"manifest": "b"}', qos=1, retain=True)
        client.publish(
            Topics(prefix, "cam-c").desired("cls"), b'{"manifest": "not asked"}', qos=1, retain=True
        )
        client.publish(trust_root(prefix), b'{"roots": []}', qos=1, retain=True)
        client.publish(Topics(prefix, "cam-a").info, b'{"platform": {"machine": "a"}}', qos=1, retain=True)
        client.publish(Topics(prefix, "cam-c").info, b'{"platform": {"machine": "c"}}', qos=1, retain=True)
        assert client.wait_published(patient(10))

        published = read_published(settings, ["cam-a", "cam-b"])

        assert published.desired == {
            "cam-a": {"cls": b'{"manifest": "a"}', "_config": b'{"manifest": "c"}'},
            "cam-b": {"cls": b'{"manifest": "b"}'},
        }
        assert published.root_chain == b'{"roots": []}'
        assert published.info == {"cam-a": b'{"platform": {"machine": "a"}}'}  # cam-b never reported
        with pytest.raises(UsageError, match="no desired state is retained for cam-d"):
            read_published(settings, ["cam-a", "cam-d"])
    finally:
        for device in ("cam-a", "cam-b", "cam-c"):
            for target in ("cls", "_config"):
                client.publish(Topics(prefix, device).desired(target), b"", qos=1, retain=True)
        client.publish(trust_root(prefix), b"", qos=1, retain=True)
        for device in ("cam-a", "cam-c"):
            client.publish(Topics(prefix, device).info, b"", qos=1, retain=True)
        client.wait_published(patient(10))
        client.stop()
