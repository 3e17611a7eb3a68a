"""Job statuses on their way out: through the durable spool, else held in memory, in order.

A full disk can refuse the spool's write. The operator must still hear how a job went, so a
status the spool refuses is held here (oldest first, bounded) and offered again, to the spool or,
while the broker is connected, straight to the link as QoS 1 from memory (paho resends it until
acknowledged while this process lives). Order is kept: nothing overtakes a held status.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

import structlog

from agent.errors import TransportError
from agent.mqtt.link import MqttLink
from agent.protocol.messages import JobStatus
from agent.protocol.topics import Topics

log = structlog.get_logger(__name__)

#: Statuses the spool could not take (disk full), held in memory in order; the oldest go first.
HELD_MAX = 256


class JobStatusSender:
    """Publishes job statuses durably; holds the ones a full disk refused until they can go."""

    def __init__(
        self,
        link: MqttLink,
        topics: Topics,
        *,
        held_max: int = HELD_MAX,
        on_held: Callable[[], None] | None = None,
    ) -> None:
        self._link = link
        self._topics = topics
        self._held: deque[JobStatus] = deque()
        self._held_max = held_max
        self._lock = threading.Lock()
        #: Told after a status was held (the delivery service's upkeep then offers it again).
        self._on_held = on_held

    def publish(self, status: JobStatus) -> None:
        """Through the spool; when it cannot take the status (disk full), held in memory, in order."""
        with self._lock:
            if not self._held and self._send(status, fallback=False):
                return
            if len(self._held) == self._held_max:
                dropped = self._held.popleft()
                log.error("delivery.job.status_dropped", job=dropped.job_id, state=dropped.state.value)
            self._held.append(status)
            log.warning("delivery.job.status_held", job=status.job_id, state=status.state.value)
        self.flush()
        if self._on_held is not None:
            self._on_held()

    def flush(self) -> None:
        """Offer the held statuses, oldest first, to the spool, else (connected) straight to the link."""
        with self._lock:
            while self._held and self._send(self._held[0], fallback=True):
                self._held.popleft()

    @property
    def held(self) -> int:
        """Statuses waiting in memory because the spool could not store them (a full disk)."""
        with self._lock:
            return len(self._held)

    def _send(self, status: JobStatus, *, fallback: bool) -> bool:
        topic = self._topics.jobs(status.job_id)
        try:
            self._link.publish(topic, status, qos=1, durable=True)
            return True
        except ValueError as exc:  # a bug: never retried
            log.error("delivery.job.publish_failed", job=status.job_id, error=str(exc))
            return True
        except TransportError as exc:
            if not fallback or not self._link.connected:
                log.debug("delivery.job.spool_refused", job=status.job_id, error=str(exc))
                return False
        # The spool is full but the broker is there: QoS 1 from memory, rather than the operator
        # never hearing how the job ended.
        try:
            self._link.publish(topic, status, qos=1)
        except TransportError as exc:
            log.error("delivery.job.publish_failed", job=status.job_id, error=str(exc))
        return True
