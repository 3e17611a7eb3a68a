"""The first start of a device that has a claim and no certificate yet: enroll before anything connects.

Part of the composition root: :func:`agent.app.root.run` calls :func:`enroll_if_needed` before it
builds the agent (whose MQTT link loads ``mqtt.tls.cert_file``), and ``edge-agent enroll`` calls
:func:`enroll_now`. While it waits for the operator, systemd is told why and given more time.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import structlog

from agent.config import AgentConfig
from agent.enrollment.claim_session import ClaimEnrollment, identity_files
from agent.enrollment.keys import CertificateFacts
from agent.watchdog.systemd import Notifier

log = structlog.get_logger(__name__)


def needs_enrollment(config: AgentConfig) -> bool:
    """Whether the first start enrolls: an ``enrollment:`` section and no certificate file yet."""
    if config.enrollment is None:
        return False
    _, cert_file, _ = identity_files(config.mqtt)
    return not cert_file.exists()


def enroll_now(
    config: AgentConfig, stop: threading.Event, notifier: Notifier | None = None
) -> CertificateFacts | None:
    """Enroll with the configured claim until issued (the facts) or ``stop`` is set (None)."""
    if config.enrollment is None:
        raise ValueError("enroll_now needs the enrollment: section")

    def on_wait(why: str, seconds: float) -> None:
        if notifier is not None:
            notifier.status(f"enrolling {config.device_id}: {why}; asking again in {seconds:.0f}s")
            notifier.extend_timeout(seconds + 120.0)

    enrollment = ClaimEnrollment(config.device_id, config.mqtt, config.enrollment, stop=stop, on_wait=on_wait)
    return enrollment.run()


def enroll_if_needed(config: AgentConfig, notifier: Notifier) -> bool:
    """Enroll on the first start when needed; False when SIGTERM/SIGINT came first (exit quietly)."""
    if not needs_enrollment(config):
        return True
    log.info("enrollment.first_start", device=config.device_id)
    stop = threading.Event()
    with _signals_set(stop):
        return enroll_now(config, stop, notifier) is not None


@contextmanager
def _signals_set(stop: threading.Event) -> Iterator[None]:
    """SIGTERM and SIGINT set ``stop`` while enrolling (the agent installs its own handlers later)."""

    def on_stop(signum: int, _frame: FrameType | None) -> None:
        log.info("enrollment.signal", signal=signal.Signals(signum).name)
        stop.set()

    before = {sig: signal.signal(sig, on_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
