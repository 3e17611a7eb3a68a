"""Every root version to every device: the chain, retained on ``{prefix}/_trust/root``.

The one online step of the trust work: it carries only what the offline steps signed, so the host
that runs it needs no key. Devices take from it what the threshold rule allows.
"""

from __future__ import annotations

from pathlib import Path

from agent.errors import TransportError
from agent.fleet.trust.versions import TrustDir
from agent.mqtt.service_client import ServiceClient
from agent.mqtt.settings import MqttSettings
from agent.protocol.messages import MAX_ROOT_CHAIN_BYTES
from agent.protocol.topics import trust_root
from agent.trust.root import check_self_signed


def publish_chain(settings: MqttSettings, directory: Path, timeout: float = 10.0) -> tuple[str, int]:
    """Publish the trust directory's root chain retained; the topic and the newest version sent.

    Refuses a newest version that a threshold of its own root keys has not signed yet: devices would
    refuse it anyway, and the operator should learn it here.
    """
    trust = TrustDir(directory)
    newest = trust.newest()
    check_self_signed(newest, "newest root")
    payload = trust.chain().model_dump_json().encode("utf-8")
    if len(payload) > MAX_ROOT_CHAIN_BYTES:
        raise TransportError(f"root chain is {len(payload)} bytes, above {MAX_ROOT_CHAIN_BYTES}")
    topic = trust_root(settings.prefix)
    client = ServiceClient(settings)
    client.start(timeout)
    try:
        client.publish(topic, payload, qos=1, retain=True)
        if not client.wait_published(timeout):
            raise TransportError(f"the broker did not acknowledge the root chain on {topic}")
    finally:
        client.stop()
    return topic, newest.signed.version
