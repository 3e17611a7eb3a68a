"""Broker settings of the operator tools: an agent-style YAML's ``mqtt:`` section and/or flags.

``fleet`` commands talk to the same broker as the devices, usually with other credentials (an
operator account whose ACL may read ``up/#`` and write ``down/#`` of every device). Flags override
what the file says.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, NoReturn

from pydantic import ValidationError

from agent.config import base_dir, read_yaml, resolve_paths
from agent.errors import ConfigError, UsageError
from agent.mqtt.settings import MqttSettings


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
    group.add_argument(
        "--client-id-prefix",
        default=None,
        help="put before every MQTT client id (the broker of docs/protocol.md wants 'fleet:')",
    )
    group.add_argument("--username", default=None, help="user name for password authentication")
    group.add_argument("--password-file", type=Path, default=None, help="file holding the password")
    group.add_argument("--tls-ca", type=Path, default=None, help="CA bundle: turns TLS on")
    group.add_argument("--tls-cert", type=Path, default=None, help="client certificate (PEM)")
    group.add_argument("--tls-key", type=Path, default=None, help="client private key (PEM)")
    group.add_argument(
        "--tls-insecure", action="store_true", help="skip broker host name verification (testing only)"
    )


def load_mqtt_section(path: Path) -> dict[str, Any]:
    """The ``mqtt:`` mapping of an agent-style YAML (or the whole file if it has no ``mqtt:`` key).

    Read by the agent's own YAML reader, and relative file paths in it are taken from the YAML
    file's directory by the agent's own rule (:func:`agent.config.base_dir`), so a file both sides
    read names the same files for both. An empty file stands for all defaults.
    """
    data = read_yaml(path, allow_empty=True)
    if "mqtt" in data:
        section = data["mqtt"]
    elif "device_id" in data or "slots" in data:
        section = {}  # an agent config without an mqtt: section: the defaults
    else:
        section = data  # a file holding only the mqtt settings
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: mqtt: must be a mapping")
    resolved: dict[str, Any] = resolve_paths(section, MqttSettings, base_dir(path))
    return resolved


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
        raise UsageError(f"--broker {value!r}: the host is missing; use HOST or HOST:PORT")
    if not port_text:
        return host, None
    try:
        return host, int(port_text)
    except ValueError as exc:
        raise UsageError(f"--broker {value!r}: port {port_text!r} is not a number") from exc


#: The flag that sets each broker setting, to name it when its value is wrong.
_FLAG_OF = {
    ("host",): "--broker",
    ("port",): "--broker",
    ("prefix",): "--prefix",
    ("client_id_prefix",): "--client-id-prefix",
    ("username",): "--username",
    ("password_file",): "--password-file",
    ("tls", "ca_file"): "--tls-ca",
    ("tls", "cert_file"): "--tls-cert",
    ("tls", "key_file"): "--tls-key",
}


def settings_from_args(args: argparse.Namespace) -> MqttSettings:
    """MqttSettings from ``-c`` (if given) overridden by the broker flags.

    A wrong flag value is a UsageError naming the flag; a wrong file value a ConfigError with its key
    path. Connection errors later name ``--broker`` unless the address came from the ``-c`` file.
    """
    values: dict[str, Any] = load_mqtt_section(args.config) if args.config is not None else {}
    flagged: set[tuple[str, ...]] = set()
    if args.broker:
        host, port = parse_broker(args.broker)
        values["host"] = host
        flagged.add(("host",))
        if port is not None:
            values["port"] = port
            flagged.add(("port",))
    for flag, key in (
        ("prefix", "prefix"),
        ("client_id_prefix", "client_id_prefix"),
        ("username", "username"),
        ("password_file", "password_file"),
    ):
        value = getattr(args, flag)
        if value is not None:
            values[key] = value
            flagged.add((key,))
    if args.tls_ca or args.tls_cert or args.tls_key or args.tls_insecure:
        tls = dict(values.get("tls") or {})
        for flag, key in (("tls_ca", "ca_file"), ("tls_cert", "cert_file"), ("tls_key", "key_file")):
            if getattr(args, flag) is not None:
                tls[key] = getattr(args, flag)
                flagged.add(("tls", key))
        if args.tls_insecure:
            tls["insecure"] = True
        values["tls"] = tls
    try:
        settings = MqttSettings.model_validate(values)
    except ValidationError as exc:
        _raise_problems(exc, flagged, args.config)
    from_file = args.config is not None and not args.broker and ("host" in values or "port" in values)
    return settings.with_address_from(f"mqtt.host/port in {args.config}" if from_file else "--broker")


def _raise_problems(exc: ValidationError, flagged: set[tuple[str, ...]], config: Path | None) -> NoReturn:
    flag_problems, file_problems = [], []
    for err in exc.errors(include_url=False):
        loc = tuple(str(p) for p in err["loc"])
        if loc in flagged:
            flag_problems.append(f"{_FLAG_OF[loc]}: {err['msg']}")
        else:
            where = f"{config}: " if config is not None else ""
            file_problems.append(f"{where}mqtt.{'.'.join(loc)}: {err['msg']}")
    if file_problems:
        raise ConfigError("invalid broker settings", file_problems + flag_problems) from exc
    raise UsageError("invalid broker flags", flag_problems) from exc
