"""Broker settings for the fleet commands: the agent YAML's mqtt: section, overridden by flags."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from agent.errors import ConfigError, UsageError
from agent.fleet.cli.connection import add_broker_arguments, parse_broker, settings_from_args


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_broker_arguments(parser)
    return parser.parse_args(list(argv))


def test_agent_config_mqtt_section_with_relative_paths(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text("pw\n")
    config = tmp_path / "agent.yaml"
    config.write_text(
        "device_id: jet-01\nmqtt:\n  host: broker.lan\n  port: 8883\n  username: ops\n"
        "  password_file: secret\n  tls:\n    ca_file: ca.pem\n  prefix: site/v1\n"
    )

    settings = settings_from_args(_args("-c", str(config)))

    assert (settings.host, settings.port, settings.username, settings.prefix) == (
        "broker.lan",
        8883,
        "ops",
        "site/v1",
    )
    assert settings.password_file == tmp_path / "secret"
    assert settings.tls is not None
    assert settings.tls.ca_file == tmp_path / "ca.pem"


def test_flags_override_the_file(tmp_path: Path) -> None:
    config = tmp_path / "mqtt.yaml"
    config.write_text("host: a\nport: 1884\n")

    settings = settings_from_args(
        _args("-c", str(config), "--broker", "b:1999", "--prefix", "x/v1", "--tls-insecure")
    )

    assert (settings.host, settings.port, settings.prefix) == ("b", 1999, "x/v1")
    assert settings.tls is not None
    assert settings.tls.insecure


def test_the_client_id_prefix_comes_from_the_file_or_the_flag(tmp_path: Path) -> None:
    config = tmp_path / "mqtt.yaml"
    config.write_text("host: a\nclient_id_prefix: 'fleet:'\n")
    assert settings_from_args(_args("-c", str(config))).client_id_prefix == "fleet:"
    assert (
        settings_from_args(_args("-c", str(config), "--client-id-prefix", "ops:")).client_id_prefix == "ops:"
    )
    with pytest.raises(UsageError) as info:
        settings_from_args(_args("--client-id-prefix", "a b"))
    assert any(p.startswith("--client-id-prefix: ") for p in info.value.problems), info.value.problems


@pytest.mark.parametrize(
    ("value", "expected"),
    [("h", ("h", None)), ("h:1", ("h", 1)), ("[::1]:8883", ("::1", 8883)), ("::1", ("::1", None))],
)
def test_parse_broker(value: str, expected: tuple[str, int | None]) -> None:
    assert parse_broker(value) == expected


def test_bad_values_name_the_flag() -> None:
    with pytest.raises(UsageError) as info:
        settings_from_args(_args("--broker", "host:70000"))
    assert any(p.startswith("--broker: ") for p in info.value.problems), info.value.problems
    with pytest.raises(ConfigError, match="not a number"):
        settings_from_args(_args("--broker", "host:http"))


def test_relative_paths_follow_the_agent_rule_through_a_linked_file(tmp_path: Path) -> None:
    # The agent takes relative paths from the directory the config was named in, not from where
    # a symlink points; the fleet tools read the same file by the same rule.
    real = tmp_path / "real"
    site = tmp_path / "site"
    real.mkdir()
    site.mkdir()
    (real / "agent.yaml").write_text("device_id: jet-01\nmqtt:\n  username: ops\n  password_file: secret\n")
    (site / "agent.yaml").symlink_to(real / "agent.yaml")

    settings = settings_from_args(_args("-c", str(site / "agent.yaml")))

    assert settings.password_file == site / "secret"


def test_a_duplicate_key_is_refused_with_its_line(tmp_path: Path) -> None:
    config = tmp_path / "mqtt.yaml"
    config.write_text("host: a\nport: 1884\nhost: b\n")

    with pytest.raises(ConfigError, match=r"duplicate key 'host' \(first at line 1\)"):
        settings_from_args(_args("-c", str(config)))


def test_an_empty_file_means_the_defaults(tmp_path: Path) -> None:
    config = tmp_path / "mqtt.yaml"
    config.write_text("")

    settings = settings_from_args(_args("-c", str(config)))

    assert (settings.host, settings.port) == ("localhost", 1883)
