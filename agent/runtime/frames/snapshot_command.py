"""The ``snapshot`` command: a stream's latest frame as a JPEG, with the result of that very frame.

Encoded only when asked, from the reference the :class:`~agent.runtime.frames.snapshots.SnapshotBoard`
holds. Bounded three ways, all set by the operator (``snapshot:`` in agent.yaml): the longest side
(``max_dimension``; a request may ask for less, never more), the bytes (``max_bytes``, and what the
MQTT payload limit leaves once the rest of the reply is counted: quality is lowered first, then the
size, until the JPEG fits; one reply, never chunks) and the rate (``per_minute``, a sliding window
over the last 60 s; more are answered ``rate_limited``, costing no encode).
"""

from __future__ import annotations

import base64
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from agent.camera.jpeg import SnapshotTooLargeError, encode_jpeg
from agent.config.models import SnapshotConfig
from agent.errors import AgentError
from agent.protocol.command_args import SnapshotArgs
from agent.protocol.messages import CommandReply, encode
from agent.runtime.frames.snapshots import Snapshot

#: Bytes kept free in the reply for the JSON around the base64 text (keys, quotes, msg_id).
_REPLY_SLACK = 512
_WINDOW_S = 60.0


class RateLimitedError(AgentError):
    """More snapshots asked for than ``snapshot.per_minute`` allows."""

    code = "rate_limited"


class NoFrameError(AgentError):
    """The stream has no frame with a published result yet."""

    code = "no_frame"


class WrongStreamError(AgentError):
    """The request names a stream the device does not have."""

    code = "wrong_stream"


class SnapshotCommand:
    """The ``snapshot`` handler over the device's streams (thread-safe)."""

    def __init__(
        self,
        config: SnapshotConfig,
        streams: Sequence[str],
        latest: Callable[[str], Snapshot | None],
        payload_limit: Callable[[], int],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``latest(stream)`` gives the stream's latest frame and result; ``payload_limit()`` the
        largest reply the link may publish now."""
        self.config = config
        self.streams = list(streams)
        self._latest = latest
        self._payload_limit = payload_limit
        self._clock = clock
        self._served: deque[float] = deque()
        self._lock = threading.Lock()

    def __call__(self, args: SnapshotArgs) -> dict[str, Any]:
        stream = args.stream or (self.streams[0] if self.streams else None)
        if stream is None or stream not in self.streams:
            known = ", ".join(self.streams) or "none"
            raise WrongStreamError(f"no stream {args.stream!r} on this device; its streams: {known}")
        self._take_turn()
        snapshot = self._latest(stream)
        if snapshot is None:
            raise NoFrameError(f"stream {stream!r} has no frame with a published result yet; retry shortly")
        dimension = min(args.max_dimension or self.config.max_dimension, self.config.max_dimension)
        result: dict[str, Any] = {
            "stream": stream,
            "frame_index": snapshot.result.frame_index,
            "captured_at": snapshot.result.captured_at,
            "source_width": int(snapshot.image.shape[1]),
            "source_height": int(snapshot.image.shape[0]),
            "result": snapshot.result.model_dump(mode="json", exclude_none=True),
        }
        # What the reply takes besides the JPEG; base64 makes 4 characters of every 3 bytes.
        rest = len(encode(CommandReply(command="snapshot", ok=True, result=result))) + _REPLY_SLACK
        budget = min(self.config.max_bytes, (self._payload_limit() - rest) * 3 // 4)
        if budget <= 0:
            raise SnapshotTooLargeError(
                f"the frame's result alone takes {rest} bytes of the {self._payload_limit()} an MQTT "
                "reply may carry: raise mqtt.max_payload_bytes"
            )
        jpeg = encode_jpeg(snapshot.image, dimension, budget, self.config.quality)
        result.update(
            width=jpeg.width,
            height=jpeg.height,
            quality=jpeg.quality,
            bytes=len(jpeg.data),
            jpeg_base64=base64.b64encode(jpeg.data).decode("ascii"),
        )
        return result

    def _take_turn(self) -> None:
        """Count this request against ``per_minute`` or raise RateLimitedError (counting nothing)."""
        limit = self.config.per_minute
        if limit == 0:
            raise RateLimitedError("snapshots are off on this device (snapshot.per_minute: 0)")
        with self._lock:
            now = self._clock()
            while self._served and now - self._served[0] >= _WINDOW_S:
                self._served.popleft()
            if len(self._served) >= limit:
                wait = _WINDOW_S - (now - self._served[0])
                raise RateLimitedError(
                    f"{limit} snapshots in the last minute (snapshot.per_minute: {limit}); "
                    f"retry in {wait:.0f} s"
                )
            self._served.append(now)
