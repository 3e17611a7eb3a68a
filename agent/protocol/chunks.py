"""The chunk protocol: what a chunk request says and how a reply names its chunk.

A device asks for chunks on ``up/xfer/req`` (:class:`ChunkRequest`); the chunk server answers each
index on the request's response topic ``down/xfer/{sha256}`` with user properties ``index`` and
``sha256`` (:data:`INDEX_PROPERTY`, :data:`SHA256_PROPERTY`).
"""

from __future__ import annotations

from pydantic import Field

from agent.model_base import StrictModel

#: User property names on a chunk reply.
INDEX_PROPERTY = "index"
SHA256_PROPERTY = "sha256"
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
