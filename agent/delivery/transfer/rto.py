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
"""

from __future__ import annotations

from dataclasses import dataclass

#: Gains of RFC 6298 (alpha 1/8 for the mean, beta 1/4 for the variation).
_ALPHA = 0.125
_BETA = 0.25
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
