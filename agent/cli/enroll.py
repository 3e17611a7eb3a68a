"""``edge-agent enroll``: enroll this device once, by hand, with the claim its configuration names."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from agent.app.first_enrollment import enroll_now, needs_enrollment
from agent.config import load_config
from agent.enrollment.certificate import held_certificate
from agent.enrollment.claim_session import identity_files
from agent.errors import ConfigError
from agent.logs.setup import configure_logging


def run_enroll(config_path: Path) -> int:
    """Enroll unless the certificate is already there; 0 once it is, 130 when interrupted."""
    config = load_config(config_path, require_models=False)
    if config.enrollment is None:
        raise ConfigError(f"{config_path}: no enrollment: section (docs/enrollment.md says what it holds)")
    configure_logging("console", config.logging.level)
    _, cert_file, _ = identity_files(config.mqtt)
    if needs_enrollment(config):
        stop = threading.Event()
        try:
            if enroll_now(config, stop) is None:
                return 130
        except KeyboardInterrupt:
            stop.set()
            return 130
    facts = held_certificate(cert_file)
    if facts is None:
        raise ConfigError(
            f"mqtt.tls.cert_file: {cert_file} holds no certificate; move it away to enroll again"
        )
    days = facts.days_left(time.time())
    print(
        f"{config.device_id}: enrolled, certificate {cert_file} serial {facts.serial} from {facts.issuer}, "
        f"expires in {days:.1f} days"
    )
    return 0
