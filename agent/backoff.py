"""Retry delays: exponential backoff with full jitter (a pure function, unit-tested).

Used by the MQTT link (reconnects) and the HTTP model source (retries after a failed GET).

paho's ``reconnect_delay_set`` doubles the delay without jitter, so after a broker restart a whole
fleet reconnects in lockstep and hammers it again. Each device here draws its delay at random
from a window that doubles with every failed attempt, bounded by ``[min_s, max_s]``.
"""

from __future__ import annotations

import random


def reconnect_delay(attempt: int, min_s: float, max_s: float, rng: random.Random | None = None) -> float:
    """Seconds to wait before reconnect attempt ``attempt`` (0 = first retry after a loss).

    Uniform in ``[min_s, min(max_s, min_s * 2 ** (attempt + 1))]``: never below ``min_s`` (spares the
    broker), never above ``max_s``, and spread even on the first retry (no lockstep).
    """
    if attempt < 0:
        raise ValueError(f"attempt must be >= 0, got {attempt}")
    if min_s <= 0 or max_s < min_s:
        raise ValueError(f"need 0 < min_s <= max_s, got min_s={min_s} max_s={max_s}")
    # Cap the exponent: 2**1000 would overflow a float long before it matters.
    ceiling = min(max_s, min_s * 2.0 ** min(attempt + 1, 60))
    return (rng or random).uniform(min_s, ceiling)
