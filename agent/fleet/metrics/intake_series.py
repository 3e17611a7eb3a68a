"""What the controller took of the devices' messages and what it dropped, as Prometheus series.

- ``edge_fleet_telemetry_messages_total``: ``up/telemetry`` messages taken into the fleet view;
- ``edge_fleet_mqtt_dropped_total{reason}``: received messages dropped before the view saw them:
  ``telemetry_shed`` (telemetry dropped first while the controller was behind) and ``inbox_full``
  (any message, once even the room kept for status, info and jobs was full).

Telemetry a device sent but the broker dropped on its way to the controller is the broker's to
count (mosquitto: ``$SYS/broker/publish/messages/dropped``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from agent.fleet.metrics.text import FamilyHead, labels_text


@dataclass(frozen=True)
class IntakeFigures:
    """The controller's message counters since start (read at each scrape)."""

    telemetry_taken: int
    telemetry_shed: int
    inbox_full: int


#: ``intake()``: the counters now.
IntakeFn = Callable[[], IntakeFigures]

TAKEN = FamilyHead(
    "edge_fleet_telemetry_messages_total",
    "counter",
    "Telemetry messages the controller took into its fleet view since start.",
)
DROPPED = FamilyHead(
    "edge_fleet_mqtt_dropped_total",
    "counter",
    "Device messages the controller received and dropped unread since start: telemetry shed while "
    "it was behind, or any message once its inbox was full.",
)


def intake_lines(figures: IntakeFigures) -> str:
    """The series of :class:`IntakeFigures` as exposition text."""
    return "".join(
        [
            TAKEN.header(),
            TAKEN.line("", float(figures.telemetry_taken)),
            DROPPED.header(),
            DROPPED.line(labels_text([("reason", "telemetry_shed")]), float(figures.telemetry_shed)),
            DROPPED.line(labels_text([("reason", "inbox_full")]), float(figures.inbox_full)),
        ]
    )
