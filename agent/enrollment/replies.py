"""What enrollment and renewal share about the controller's answers: a bounded inbox of decoded
replies (filled on the MQTT dispatcher's thread, read by the waiting one) and the wait before asking
again (at least the reply's ``retry_after_s``, growing with each failure, jittered)."""

from __future__ import annotations

import queue
import random

import structlog

from agent.backoff import reconnect_delay
from agent.mqtt.inbound import InboundMessage
from agent.protocol.enrollment import EnrollReply
from agent.protocol.messages import ProtocolError, decode

log = structlog.get_logger(__name__)

#: Replies waiting to be read; more are dropped (and counted): the waiting side asks again.
_INBOX_SIZE = 16


class ReplyInbox:
    """Decoded :class:`EnrollReply` messages, a bounded few; what does not decode is counted."""

    def __init__(self) -> None:
        self._replies: queue.Queue[EnrollReply] = queue.Queue(maxsize=_INBOX_SIZE)
        #: Replies dropped here: malformed, or more than the inbox holds.
        self.dropped = 0

    def on_message(self, message: InboundMessage) -> None:
        """The MQTT dispatcher's handler: decode and hand over, nothing more."""
        try:
            reply = decode(EnrollReply, message.payload)
        except ProtocolError as exc:
            self.dropped += 1
            log.warning("enrollment.reply.invalid", topic=message.topic, error=str(exc))
            return
        try:
            self._replies.put_nowait(reply)
        except queue.Full:
            self.dropped += 1

    def take(self, timeout: float) -> EnrollReply | None:
        """The next reply, or None after ``timeout`` seconds."""
        try:
            return self._replies.get(timeout=timeout)
        except queue.Empty:
            return None

    def drain(self) -> None:
        """Forget replies that came in while nobody waited (they answer an older request)."""
        while True:
            try:
                self._replies.get_nowait()
            except queue.Empty:
                return


def log_answer(event: str, reply: EnrollReply) -> None:
    """Log an answer that is not a certificate: its outcome, code, one line and the wait it asks for."""
    log.warning(
        event,
        outcome=reply.outcome,
        code=reply.code,
        message=reply.message,
        retry_after_s=reply.retry_after_s,
    )


def retry_delay(failures: int, retry_after_s: float, min_s: float, max_s: float, rng: random.Random) -> float:
    """Seconds to wait after ``failures`` failed requests: jittered, doubling from the longer of
    ``min_s`` and the controller's ``retry_after_s``, at most the longer of ``max_s`` and it."""
    low = max(min_s, retry_after_s)
    return reconnect_delay(failures, low, max(low, max_s), rng)
