"""Broker settings of the operator tools: an agent-style YAML's ``mqtt:`` section and/or flags.

``fleet`` commands talk to the same broker as the devices, usually with other credentials (an
operator account whose ACL may read ``up/#`` and write ``down/#`` of every device). Flags override
what the file says.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from agent.errors import ConfigError
from agent.mqtt.settings import MqttSettings

_PATH_KEYS = ("password_file",)
_TLS_PATH_KEYS = ("ca_file", "cert_file", "key_file")


def add_broker_arguments(parser: argparse.ArgumentParser) -> None:
    """The broker flags every ``fleet`` command takes."""
    group = parser.add_argument_group("broker")
    group.add_argument(
        "-c",
        "--config",
        type=Path,
        default=None,
        help="YAML file whose mqtt: section (agent config format) says how to reach the broker",
    )
    group.add_argument("--broker", default=None, metavar="HOST[:PORT]", help="broker address")
    group.add_argument("--prefix", default=None, help="topic prefix (default fleet/v1)")
    group.add_argument("--username", default=None, help="user name for password authentication")
    group.add_argument("--password-file", type=Path, default=None, help="file holding the password")
    group.add_argument("--tls-ca", type=Path, default=None, help="CA bundle: turns TLS on")
    group.add_argument("--tls-cert", type=Path, default=None, help="client certificate (PEM)")
    group.add_argument("--tls-key", type=Path, default=None, help="client private key (PEM)")
    group.add_argument(
        "--tls-insecure", action="store_true", help="skip broker host name verification (testing only)"
    )


def _resolve(value: Any, base: Path) -> Any:
    if isinstance(value, str) and value and not Path(value).is_absolute():
        return str(base / value)
    return value


def load_mqtt_section(path: Path) -> dict[str, Any]:
    """The ``mqtt:`` mapping of an agent-style YAML (or the whole file if it has no ``mqtt:`` key).

    Relative file paths in it are taken from the YAML file's directory, as the agent does.
    """
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with an mqtt: section")
    if "mqtt" in data:
        section = data["mqtt"]
    elif "device_id" in data or "slots" in data:
        section = {}  # an agent config without an mqtt: section: the defaults
    else:
        section = data  # a file holding only the mqtt settings
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: mqtt: must be a mapping")
    section = dict(section)
    base = Path(path).resolve().parent
    for key in _PATH_KEYS:
        if key in section:
            section[key] = _resolve(section[key], base)
    if isinstance(section.get("tls"), dict):
        tls = dict(section["tls"])
        for key in _TLS_PATH_KEYS:
            if key in tls:
                tls[key] = _resolve(tls[key], base)
        section["tls"] = tls
    return section


def parse_broker(value: str) -> tuple[str, int | None]:
    """``host``, ``host:port`` or ``[v6addr]:port`` into (host, port or None)."""
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif value.count(":") == 1:
        host, _, port_text = value.partition(":")
    else:
        host, port_text = value, ""
    if not host:
        raise ConfigError(f"--broker {value!r}: the host is missing; use HOST or HOST:PORT")
    if not port_text:
        return host, None
    try:
        return host, int(port_text)
    except ValueError as exc:
        raise ConfigError(f"--broker {value!r}: port {port_text!r} is not a number") from exc


def settings_from_args(args: argparse.Namespace) -> MqttSettings:
    """MqttSettings from ``-c`` (if given) overridden by the broker flags; ConfigError with key paths."""
    values: dict[str, Any] = load_mqtt_section(args.config) if args.config is not None else {}
    if args.broker:
        host, port = parse_broker(args.broker)
        values["host"] = host
        if port is not None:
            values["port"] = port
    for flag, key in (("prefix", "prefix"), ("username", "username"), ("password_file", "password_file")):
        value = getattr(args, flag)
        if value is not None:
            values[key] = value
    if args.tls_ca or args.tls_cert or args.tls_key or args.tls_insecure:
        tls = dict(values.get("tls") or {})
        for flag, key in (("tls_ca", "ca_file"), ("tls_cert", "cert_file"), ("tls_key", "key_file")):
            if getattr(args, flag) is not None:
                tls[key] = getattr(args, flag)
        if args.tls_insecure:
            tls["insecure"] = True
        values["tls"] = tls
    try:
        return MqttSettings.model_validate(values)
    except ValidationError as exc:
        problems = [
            f"mqtt.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"
            for err in exc.errors(include_url=False)
        ]
        raise ConfigError("invalid broker settings", problems) from exc
