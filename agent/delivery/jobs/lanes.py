"""Per-slot job lanes: one worker thread per slot, at most one job running and one queued."""

from __future__ import annotations

import threading
from collections.abc import Callable

from agent.delivery.jobs.deployment import Deployment


class SlotLane:
    """One slot's jobs: at most one running and one queued (a newer manifest replaces the queued one)."""

    def __init__(self, slot: str, on_run: Callable[[Deployment], None]) -> None:
        self.slot = slot
        self.cond = threading.Condition()
        self.pending: Deployment | None = None
        self.running: Deployment | None = None
        self.stopping = False
        self._on_run = on_run
        self.thread = threading.Thread(target=self._loop, name=f"delivery-{slot}", daemon=True)
        self.thread.start()

    def in_flight(self) -> list[Deployment]:
        with self.cond:
            return [d for d in (self.running, self.pending) if d is not None]

    def submit(self, job: Deployment) -> Deployment | None:
        """Queue ``job``, cancelling the running one; return the queued job it replaced, if any."""
        with self.cond:
            replaced, self.pending = self.pending, job
            if self.running is not None:
                self.running.cancel("superseded", superseded_by=job.job_id)
            self.cond.notify_all()
        return replaced

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            if self.running is not None:
                self.running.cancel("stopping")
            self.cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self.cond:
                # No timeout: submit() and stop() notify. An idle lane sleeps until then (a thousand
                # simulated devices on two cores paid a wake-up per lane and second for nothing).
                while self.pending is None and not self.stopping:
                    self.cond.wait()
                if self.stopping:
                    return
                job, self.pending = self.pending, None
                self.running = job
            try:
                if job is not None:
                    self._on_run(job)
            finally:
                with self.cond:
                    self.running = None
