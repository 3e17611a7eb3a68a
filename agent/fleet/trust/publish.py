"""Every root version to every device: the chain, retained on ``{prefix}/_trust/root``.

The one online step of the trust work: it carries only what the offline steps signed, so the host
that runs it needs no key. Devices take from it what the threshold rule allows.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from agent.errors import TransportError
from agent.fleet.trust.versions import TrustDir
from agent.mqtt.service_client import ServiceClient
from agent.mqtt.settings import MqttSettings
from agent.protocol.messages import MAX_ROOT_CHAIN_BYTES, RootChain
from agent.protocol.topics import trust_root
from agent.signing import Ed25519PrivateKey, sign
from agent.trust.root import check_self_signed, read_root


def adoption(chain: RootChain, key: Ed25519PrivateKey, key_id: str) -> RootChain:
    """``chain`` vouched for by a key devices without a root already trust (``delivery.trusted_keys``):
    they adopt its first version and, from then on, require releases (docs/trust.md)."""
    first = read_root(json.dumps(chain.roots[0]).encode("utf-8"), "root chain item 0")
    signature = base64.b64encode(sign(key, first.signed_bytes)).decode("ascii")
    return chain.model_copy(update={"adopt_key_id": key_id, "adopt_signature": signature})


def publish_chain(
    settings: MqttSettings,
    directory: Path,
    timeout: float = 10.0,
    adopt: tuple[Ed25519PrivateKey, str] | None = None,
) -> tuple[str, int]:
    """Publish the trust directory's root chain retained; the topic and the newest version sent.

    Refuses a newest version that a threshold of its own root keys has not signed yet: devices would
    refuse it anyway, and the operator should learn it here. ``adopt``: a trusted key and its id that
    vouch for the root to devices that have none yet (:func:`adoption`).
    """
    trust = TrustDir(directory)
    newest = trust.newest()
    check_self_signed(newest, "newest root")
    chain = trust.chain()
    if adopt is not None:
        chain = adoption(chain, *adopt)
    payload = chain.model_dump_json().encode("utf-8")
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
