"""The chunk protocol: what a chunk request says and how a reply names its chunk.

A device asks for chunks on ``up/xfer/req`` (:class:`ChunkRequest`); the chunk server answers each
index on the request's response topic ``down/xfer/{sha256}`` with user properties ``index`` and
``sha256`` (:data:`INDEX_PROPERTY`, :data:`SHA256_PROPERTY`).

Pacing: a device that says how long it waits before asking again (:data:`TIMEOUT_PROPERTY` on its
request) is told by the server, on the same response topic, when its chunks wait in a long line
(a *wait notice*, :data:`WAIT_PROPERTY`) or when the server has no room for them (a *busy notice*,
:data:`RETRY_PROPERTY`): an empty payload with those user properties and the request's correlation
data. Both travel as MQTT 5 user properties, never as fields of :class:`ChunkRequest`: a server
ignores user properties it does not know, while its strict request model would refuse a new field
(a newer device must keep working with an older server, and an older device never asks for notices).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import Field

from agent.model_base import StrictModel

#: User property names on a chunk reply.
INDEX_PROPERTY = "index"
SHA256_PROPERTY = "sha256"
#: Request user property: the device's current re-request timeout in ms (it understands notices).
TIMEOUT_PROPERTY = "timeout_ms"
#: Notice user properties: ms until the request's chunks are expected to leave, chunks waiting ahead.
WAIT_PROPERTY = "wait_ms"
AHEAD_PROPERTY = "ahead"
#: Busy notice user property: ms after which the device may ask again (nothing of the request waits).
RETRY_PROPERTY = "retry_ms"
#: Longest wait or retry a notice may name; a larger value is read as this (the job deadline bounds all).
MAX_NOTICE_MS = 300_000
#: Most indices one request may name (a request never asks for more than the window anyway).
MAX_INDICES = 256


class ChunkRequest(StrictModel):
    """``up/xfer/req`` payload: please send these chunks of the model with this SHA-256.

    Published with MQTT 5 ResponseTopic ``{prefix}/{device}/down/xfer/{sha256}`` and CorrelationData
    (a request id the server echoes). ``chunk_size`` lets a server that has the file but not the
    manifest (``fleet serve --repo``) cut the chunks.
    """

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the whole model file.")
    indices: list[int] = Field(min_length=1, max_length=MAX_INDICES, description="Chunk indices wanted.")
    chunk_size: int | None = Field(None, gt=0, description="Chunk size of the device's manifest.")
    device: str | None = Field(None, description="Requesting device id (must match the topic's).")


@dataclass(frozen=True)
class ChunkNotice:
    """A server's word about a chunk request, from a reply without an ``index``: wait or come back.

    ``wait_ms``: the request's chunks are queued and expected to leave within this time (``ahead``
    chunks of other requests before them). ``retry_ms``: the server is busy and queued nothing of the
    request; ask again after this time.
    """

    wait_ms: int | None = None
    ahead: int | None = None
    retry_ms: int | None = None


def read_notice(user_properties: Mapping[str, str]) -> ChunkNotice | None:
    """The notice a reply's user properties carry, or None when they carry none or a garbled one.

    Values are clamped to ``0..MAX_NOTICE_MS``: nothing a server says may stall a pull for longer
    (the device trusts the server for timing hints only, never for bytes).
    """

    def number(key: str) -> int | None:
        text = user_properties.get(key)
        if text is None or not text.isdigit() or len(text) > 12:
            return None
        return min(int(text), MAX_NOTICE_MS)

    wait, retry = number(WAIT_PROPERTY), number(RETRY_PROPERTY)
    if wait is None and retry is None:
        return None
    return ChunkNotice(wait_ms=wait, ahead=number(AHEAD_PROPERTY), retry_ms=retry)


def notice_properties(notice: ChunkNotice) -> tuple[tuple[str, str], ...]:
    """``notice`` as the user properties of a notice reply."""
    fields = (
        (WAIT_PROPERTY, notice.wait_ms),
        (AHEAD_PROPERTY, notice.ahead),
        (RETRY_PROPERTY, notice.retry_ms),
    )
    return tuple((key, str(value)) for key, value in fields if value is not None)
