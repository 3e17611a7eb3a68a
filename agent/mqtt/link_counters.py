"""The device link's counters (published, dropped, refused, reconnects, ...): counted by any of the
link's threads, read by telemetry (``mqtt.*``), with the broker's answers to QoS 1 publishes
(PUBACK codes) counted into them and its refusals logged, once per episode.

One job (the counts and their one lock), shared by the link's connection (:mod:`agent.mqtt.link`)
and its durable messages (:mod:`agent.mqtt.durable`).
"""

from __future__ import annotations

import threading

import structlog

from agent.mqtt.core import NOT_AUTHORIZED

log = structlog.get_logger(__name__)

#: Every counter of the link, in the order telemetry lists them.
LINK_COUNTERS = (
    "published",
    "dropped_offline",
    "dropped_queue_full",
    "refused_oversize",
    "acl_denied",
    "broker_refused",
    "callback_errors",
    "handler_errors",
    "reconnects",
    "connect_failures",
    "inbox_dropped",
    "spool_fallback_memory",
    "certificate_moves",
    "certificate_move_failures",
)


class LinkCounters:
    """The link's counters since start, safe to count from any thread."""

    def __init__(self, client_id: str) -> None:
        self._client_id = client_id
        self._counts = dict.fromkeys(LINK_COUNTERS, 0)
        self._lock = threading.Lock()
        self._denied_run = 0  # refusals (0x87) since the last accepted QoS 1 publish or connect

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name``."""
        with self._lock:
            self._counts[name] += n

    def get(self, name: str) -> int:
        """Counter ``name`` now."""
        with self._lock:
            return self._counts[name]

    def snapshot(self) -> dict[str, float]:
        """Every counter now."""
        with self._lock:
            return {k: float(v) for k, v in self._counts.items()}

    # -- the network thread --------------------------------------------------------------------

    def puback(self, mid: int, code: int, reason: str, spool_id: int | None) -> None:
        """Count what the broker answered to QoS 1 publish ``mid`` (``spool_id``: its row, if durable)."""
        if code < 0x80:
            self.count("published")
            self.accepted()
        elif code == NOT_AUTHORIZED:
            # Retrying cannot succeed: count it and (if durable) drop it from the spool. Logged once
            # per episode: a misconfigured device is refused at frame rate (durable results).
            self.count("acl_denied")
            self._denied_run += 1
            if self._denied_run == 1:
                log.error(
                    "mqtt.publish.denied",
                    mid=mid,
                    reason=reason,
                    spool_id=spool_id,
                    client_id=self._client_id,
                    hint="the broker's ACL refuses this topic for this user name; if every topic is "
                    "refused, the device id is not the certificate CN. Logged once until a publish "
                    "is accepted again; counted in mqtt.acl_denied",
                )
        else:
            self.count("broker_refused")
            log.error("mqtt.publish.refused", mid=mid, reason=reason, spool_id=spool_id)

    def accepted(self) -> None:
        """A publish or a connection was accepted: an episode of ACL refusals is over."""
        if self._denied_run:
            log.warning("mqtt.publish.denied.ended", refused=self._denied_run, client_id=self._client_id)
            self._denied_run = 0
