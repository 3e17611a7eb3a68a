"""The fleet controller's configuration file (``edge-agent fleet controller --config FILE``).

The same YAML reader, relative-path rule and error text as the agent's own configuration: a
problem names its key (``http.port: Input should be greater than 0``). configs/controller.yaml is
the documented example; a test loads it.
"""

from __future__ import annotations

import ipaddress
import os
import re
import stat
from pathlib import Path

from pydantic import Field, ValidationError, field_validator

from agent.config import base_dir, read_yaml, resolve_paths
from agent.config.problems import config_error, describe
from agent.errors import ConfigError
from agent.fleet.engines.settings import EngineShareSettings
from agent.fleet.enrollment.settings import EnrollmentSettings
from agent.fleet.samples.store import SampleBounds
from agent.fleet.statedb.settings import DatabaseSettings
from agent.model_base import StrictModel
from agent.mqtt.settings import MqttSettings

#: The controller's default state directory (the systemd unit's StateDirectory).
DEFAULT_STATE_DIR = Path("/var/lib/edge-fleet-controller")
#: A DNS name as ``http.allowed_hosts`` takes it: labels of letters, digits and ``-``, dot-separated.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST_NAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*\.?$")


class HttpSettings(StrictModel):
    """The controller's web console and ``/metrics``; off unless ``port`` is set."""

    host: str = Field("127.0.0.1", description="Address to bind; loopback unless told otherwise.")
    port: int | None = Field(None, gt=0, lt=65536, description="Port of the console and /metrics.")
    token_file: Path | None = Field(
        None, description="File holding the bearer token console actions need (none: read-only)."
    )
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="Host names the console answers besides localhost, IP addresses and the bind "
        "address (a TLS proxy's server_name, a Prometheus target's name); any other Host gets 403.",
    )

    @field_validator("allowed_hosts")
    @classmethod
    def _host_names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not _is_host(name):
                raise ValueError(
                    f"{name!r} is not a host name: give the name alone (fleet.example.com), "
                    "without scheme, port or path"
                )
        return names


def _is_host(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return bool(_HOST_NAME.match(name))
    return True


class ControllerConfig(StrictModel):
    """Where the broker is, where the state lives, which key signs the desired states."""

    mqtt: MqttSettings = Field(default_factory=MqttSettings)
    state_dir: Path = Field(DEFAULT_STATE_DIR, description="rollouts.sqlite and models/ live here.")
    signing_key: Path | None = Field(
        None,
        description="Ed25519 private key (PEM) that signs desired states; readable by the controller only.",
    )
    key_id: str | None = Field(None, description="The key's id in the devices' delivery.trusted_keys.")
    unsigned: bool = Field(False, description="Publish unsigned desired states (test fleets only).")
    http_source: str | None = Field(
        None,
        description="Base URL where the models directory is served over HTTP: manifests list "
        "{http_source}/{sha256}.onnx before the MQTT pull.",
    )
    status_poll_s: float = Field(15.0, gt=0, description="Ask a device quiet this long for its job state.")
    select_wait_s: float = Field(
        3.0, gt=0, description="How long to read the devices' retained up/info when a rollout starts."
    )
    stale_after_s: float = Field(
        60.0, gt=0, description="A device silent this long is stale: its series leave /metrics."
    )
    max_devices: int = Field(
        10_000,
        gt=0,
        description="Devices the controller's live view holds (console, /metrics); each takes at most "
        "~0.4 MB there (docs/console.md). A full view makes room from devices gone quiet.",
    )
    forget_after_s: float = Field(
        7 * 86400.0,
        gt=0,
        description="A device not online and not heard this long leaves the live view (decommission "
        "forgets one at once).",
    )
    http: HttpSettings = Field(default_factory=HttpSettings)
    standby: bool = Field(
        False,
        description="When another controller holds the prefix: wait and take over when it stops "
        "(false: refuse to start, naming the holder).",
    )
    lease_ttl_s: int = Field(
        60, ge=3, le=86_400, description="The prefix lease's claim expires this long after its last renewal."
    )
    database: DatabaseSettings = Field(
        default_factory=DatabaseSettings,
        description="PostgreSQL for the rollouts, the lease, the model repository and the samples "
        '(docs/fleet.md, "The store"); unset: SQLite under state_dir and the lease on the broker.',
    )

    samples: SampleBounds = Field(
        default_factory=SampleBounds,
        description="The store of the devices' opt-in samples for retraining ({state_dir}/samples, or "
        "the database with database.url).",
    )

    engines: EngineShareSettings = Field(
        default_factory=EngineShareSettings,
        description="Engines shared between devices ({state_dir}/engines): on by default, bounded.",
    )

    enrollment: EnrollmentSettings = Field(
        default_factory=EnrollmentSettings,
        description="Devices enrolling with a claim and renewing their certificates (docs/enrollment.md); "
        "off unless ca_dir is set.",
    )

    @property
    def enrollment_path(self) -> Path:
        return self.state_dir / "enrollment.sqlite"

    @property
    def engines_dir(self) -> Path:
        return self.state_dir / "engines"

    @property
    def samples_dir(self) -> Path:
        return self.state_dir / "samples"

    @property
    def models_dir(self) -> Path:
        return self.state_dir / "models"

    @property
    def store_path(self) -> Path:
        return self.state_dir / "rollouts.sqlite"


def load_controller_config(path: Path) -> ControllerConfig:
    """Read and check ``path`` (ConfigError listing every problem by key)."""
    path = Path(path)
    data = read_yaml(path, allow_empty=True)
    data = resolve_paths(data, ControllerConfig, base_dir(path))
    try:
        config = ControllerConfig.model_validate(data)
    except ValidationError as exc:
        raise config_error(path, [describe(e) for e in exc.errors()], {}) from exc
    problems = key_problems(config)
    if problems:
        raise ConfigError(f"{path}: the signing key cannot be used", problems)
    return config


def key_problems(config: ControllerConfig) -> list[str]:
    """What is wrong with the signing key settings: missing, unreadable, or readable by others."""
    if config.unsigned:
        return ["signing_key: give no key with unsigned: true"] if config.signing_key else []
    if config.signing_key is None or not config.key_id:
        return ["signing_key and key_id: both are needed (or unsigned: true for a test fleet)"]
    try:
        mode = config.signing_key.stat().st_mode
    except OSError as exc:
        return [f"signing_key: {config.signing_key}: {exc.strerror or exc}"]
    if mode & (stat.S_IRWXG | stat.S_IRWXO) and os.name == "posix":
        return [
            f"signing_key: {config.signing_key} is readable by others (mode {stat.S_IMODE(mode):o}); "
            "chmod 600 it: only the controller may read the key"
        ]
    return []
