"""How long a device waits for a chunk before asking again: the configured floor, or more when the
answers are slow. Pure.

At fleet scale the chunk server and the broker answer hundreds of devices at once, and a reply can
take longer than ``delivery.chunk_timeout_s`` without being lost. A fixed timeout then re-requests
chunks that are still on their way, the server sends them twice, and the extra load slows every
answer further (tests/delivery/test_transfer.py). The timer follows TCP's retransmission timer (RFC 6298,
Jacobson/Karels): a smoothed round-trip time and its variation from answered chunks, ``timeout =
srtt + 4 * rttvar``, never below the configured floor nor above a ceiling. Each chunk reply carries
its request's correlation data, so its round trip is known even for a chunk asked for twice (what
TCP needs timestamps for).

The server may also say how long the wait will be (docs/delivery.md, "Pacing"): a *wait notice*
moves the timeout of what is outstanding past the wait it names (:func:`due_after_wait`), a *busy
notice* holds new requests until the time it names (:func:`resume_after_busy`).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Gains of RFC 6298 (alpha 1/8 for the mean, beta 1/4 for the variation).
_ALPHA = 0.125
_BETA = 0.25
#: A wait the server names is stretched by this factor: its estimate is of a rate that moves.
WAIT_MARGIN = 1.5
#: Devices told "busy" at once come back spread over this share of the retry time beyond it.
BUSY_SPREAD = 0.5
#: Longest base timeout (backoff doubles it per attempt on top; the job deadline bounds everything).
DEFAULT_CEILING_S = 60.0


@dataclass
class RetransmitTimer:
    """Round-trip estimate of one pull; ``timeout`` is the base wait before a chunk is asked again."""

    floor_s: float
    ceiling_s: float = DEFAULT_CEILING_S
    srtt: float | None = None
    rttvar: float = 0.0
    samples: int = 0

    def sample(self, rtt_s: float) -> None:
        """Take one round trip: the request sent, the chunk it asked for written."""
        rtt_s = max(0.0, rtt_s)
        if self.srtt is None:
            self.srtt, self.rttvar = rtt_s, rtt_s / 2
        else:
            self.rttvar = (1 - _BETA) * self.rttvar + _BETA * abs(self.srtt - rtt_s)
            self.srtt = (1 - _ALPHA) * self.srtt + _ALPHA * rtt_s
        self.samples += 1

    @property
    def timeout(self) -> float:
        """The floor until answers are measured; then ``srtt + 4 * rttvar`` within floor and ceiling."""
        if self.srtt is None:
            return self.floor_s
        return max(self.floor_s, min(self.ceiling_s, self.srtt + 4 * self.rttvar))


def due_after_wait(now: float, wait_s: float, timeout_s: float) -> float:
    """When to ask again for chunks the server said wait ``wait_s`` in its line: the stretched wait,
    then the usual timeout (the chunks still have to travel once they leave)."""
    return now + WAIT_MARGIN * max(0.0, wait_s) + timeout_s


def resume_after_busy(now: float, retry_s: float, spread: float) -> float:
    """When to ask again after a busy notice naming ``retry_s``; ``spread`` in [0, 1) (random per
    device) keeps the devices refused together from coming back together."""
    return now + max(0.0, retry_s) * (1 + BUSY_SPREAD * spread)
