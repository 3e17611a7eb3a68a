"""What the project relies on the MQTT broker for: each feature, and where the code uses it.

A broker that lacks one of these, or provides it differently on a cluster, changes how the fleet
behaves: docs/scale.md's table says how, feature by feature, and tests/protocol/test_scale_doc.py
checks that its table names exactly these features and that the modules where each ``marker``
appears are exactly its ``uses``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BrokerFeature:
    """One broker feature: its name in docs/scale.md, the text in the code that means it is used,
    and every module (path from the repository root) where that text is."""

    name: str
    marker: str
    uses: tuple[str, ...]


BROKER_FEATURES = (
    BrokerFeature(
        "retained messages",
        "retain=True",
        (
            "agent/mqtt/link.py",  # up/status, and its Last Will
            "agent/app/device_reports.py",  # up/info
            "agent/app/root.py",  # an imported bundle's desired states, handed in as the retained ones
            "agent/fleetsim/device.py",  # the simulated devices' up/info
            "agent/fleet/deploy/run.py",  # down/desired/{slot}
            "agent/fleet/deploy/decommission.py",  # clearing a device's retained topics
            "agent/fleet/trust/publish.py",  # the fleet root
            "agent/fleet/controller/lease.py",  # the controller's claim on its prefix
        ),
    ),
    BrokerFeature(
        "shared subscriptions",
        "$share/",
        ("agent/mqtt/service_client.py", "agent/fleet/chunks/server.py"),  # chunk requests
    ),
    BrokerFeature(
        "message expiry",
        "message_expiry_s=",
        (
            "agent/mqtt/durable.py",  # durable results
            "agent/fleet/chunks/server.py",  # chunks and notices
            "agent/fleet/controller/lease.py",  # the claim outlives no dead holder
        ),
    ),
    BrokerFeature(
        "Last Will",
        "will_set(",
        (
            "agent/mqtt/core.py",
            "agent/mqtt/link.py",  # a device's offline status
            "agent/mqtt/service_client.py",  # the lease connection clears the claim
        ),
    ),
    BrokerFeature("persistent sessions", "clean_start=False", ("agent/mqtt/core.py",)),
    BrokerFeature(
        "client-id takeover",
        "taken_over",
        (
            "agent/mqtt/events.py",
            "agent/mqtt/service_client.py",
            "agent/fleet/controller/lease.py",  # two controllers: the later connection wins
        ),
    ),
)
