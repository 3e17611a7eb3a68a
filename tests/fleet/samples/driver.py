"""Adds samples to a real PostgreSQL samples store without end, as a child process to be killed.

``python -m tests.fleet.samples.driver ADDRESS`` opens the store at ADDRESS (a libpq URL) with the
bounds :data:`BOUNDS` and adds a sample of one of three devices, round, printing ``added SEQ`` after
each add returned (committed), so the parent knows what the store must hold when it kills the child.
"""

from __future__ import annotations

import sys

from agent.fleet.samples.pg_store import PostgresSampleStore
from agent.fleet.samples.store import SampleBounds
from agent.fleet.statedb.postgres import StateDatabase
from tests.fleet.samples.made import low_class, made_sample

#: Tight enough that almost every add evicts: by count, by bytes or by device.
BOUNDS = SampleBounds.model_construct(max_count=7, max_bytes=6 * 16 * 1024, per_device=3)
DEVICES = ("cam-0", "cam-1", "cam-2")


def main(address: str) -> None:
    store = PostgresSampleStore(StateDatabase(address), BOUNDS)
    made = [made_sample(low_class(), frame) for frame in range(8)]
    n = 0
    while True:
        stored = store.add(DEVICES[n % 3], made[n % len(made)].model_copy(update={"msg_id": f"m{n}"}))
        assert stored is not None
        print(f"added {stored.seq}", flush=True)
        n += 1


if __name__ == "__main__":
    main(sys.argv[1])
