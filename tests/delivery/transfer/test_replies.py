"""A transfer's reply queue: bounded for replies, never for the wake-ups of its own flusher."""

from __future__ import annotations

import queue

import pytest

from agent.delivery.transfer.replies import ChunkReply, ReplyQueue
from agent.mqtt.inbound import InboundMessage


def _reply(index: int) -> ChunkReply:
    message = InboundMessage(topic="t", payload=bytes([index]), qos=1, retain=False)
    return ChunkReply(message, digest=f"d{index}")


def test_replies_beyond_the_bound_are_refused_and_wake_ups_never_are() -> None:
    replies = ReplyQueue(maxsize=3)
    assert [replies.offer(_reply(i)) for i in range(5)] == [True, True, True, False, False]
    replies.wake()  # a flush ended: the transfer must hear of it even with its queue full
    assert replies.qsize() == 4
    taken = [replies.get_nowait() for _ in range(4)]
    assert [r.digest if r is not None else None for r in taken] == ["d0", "d1", "d2", None]
    with pytest.raises(queue.Empty):
        replies.get(timeout=0.01)
    assert replies.offer(_reply(9))  # room again once taken
