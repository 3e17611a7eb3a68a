"""The controller's configuration file, its documented example, and its systemd unit."""

from __future__ import annotations

import configparser
import re
import secrets
import shutil
from pathlib import Path

import pytest

from agent.cli import main
from agent.config import read_yaml
from agent.errors import ConfigError
from agent.fleet.controller.config import (
    DEFAULT_STATE_DIR,
    ControllerConfig,
    key_problems,
    load_controller_config,
)
from agent.fleet.deploy.keys import write_keypair
from agent.fleet.rollout.pg_store import PostgresRolloutStore
from agent.fleet.rollout.store import RolloutStoreError
from agent.fleet.statedb.postgres import StateDatabase, conninfo_of
from tests.postgres_server import PostgresServer
from tests.unit_files import analyze_verify, read_unit

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "configs" / "controller.yaml"
UNIT = REPO / "systemd" / "edge-fleet-controller.service"


def test_the_documented_example_parses_and_names_its_missing_key() -> None:
    config = ControllerConfig.model_validate(read_yaml(EXAMPLE))
    assert config.mqtt.port == 8883
    assert config.store_path == Path("/var/lib/edge-fleet-controller/rollouts.sqlite")
    assert config.http.port is None
    # The key the example names is not on this machine: the problem names the key and the file.
    (problem,) = key_problems(config)
    assert problem.startswith("signing_key: /etc/edge-fleet-controller/fleet-2026.key")


def test_a_key_others_can_read_is_refused_and_a_private_one_loads(tmp_path: Path) -> None:
    keys = write_keypair(tmp_path / "keys", "ops")
    path = tmp_path / "controller.yaml"
    path.write_text(f"state_dir: state\nsigning_key: {keys.private}\nkey_id: ops\n")
    config = load_controller_config(path)
    assert config.state_dir == tmp_path / "state"  # relative to the file
    keys.private.chmod(0o644)
    with pytest.raises(ConfigError) as refused:
        load_controller_config(path)
    assert "chmod 600" in " ".join(refused.value.problems)


def test_a_bad_value_is_named_by_its_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "controller.yaml"
    path.write_text("unsigned: true\nhttp: {port: 0}\n")
    assert main(["fleet", "controller", "--config", str(path)]) != 0
    assert "http.port" in capsys.readouterr().err


def _unit() -> configparser.ConfigParser:
    return read_unit(UNIT)


def test_the_unit_runs_the_controller_as_its_own_user_with_private_state() -> None:
    service = _unit()["Service"]
    assert service["ExecStart"].endswith(
        "edge-agent fleet controller --config /etc/edge-fleet-controller/controller.yaml"
    )
    assert service["User"] == "edge-fleet-controller"
    assert service["StateDirectory"] == "edge-fleet-controller"
    assert service["StateDirectoryMode"] == "0700"
    assert service["UMask"] == "0077"
    assert service["Restart"] == "on-failure"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    analyze_verify(UNIT, tmp_path)


def test_one_state_dir_default_for_the_controller_the_unit_and_the_example() -> None:
    # The unit's StateDirectory= lives under /var/lib; the example and `fleet samples export`'s
    # default must name that same directory, or export looks where the controller never writes.
    unit_dir = Path("/var/lib") / _unit()["Service"]["StateDirectory"]
    assert unit_dir == DEFAULT_STATE_DIR
    assert ControllerConfig.model_validate(read_yaml(EXAMPLE)).state_dir == unit_dir
    assert ControllerConfig.model_validate({"unsigned": True}).state_dir == unit_dir
    for page in ("cli.md", "fleet.md"):
        text = (REPO / "docs" / page).read_text()
        assert str(unit_dir) in text
        assert "/var/lib/edge-agent-controller" not in text


def test_the_example_names_every_section_and_the_samples_bounds_docs_fleet_md_gives() -> None:
    """configs/controller.yaml is where an operator starts: each section of the configuration is in
    it (``unsigned``, for test fleets only, is left out on purpose), and the ``samples:`` bounds are
    the defaults docs/fleet.md states."""
    example = read_yaml(EXAMPLE)
    assert set(ControllerConfig.model_fields) - set(example) == {"unsigned"}
    doc = (REPO / "docs" / "fleet.md").read_text(encoding="utf-8")
    found = re.findall(r"`(max_count|max_bytes|per_device)` \(default (\d+)( MiB)?[,)]", doc)
    stated = {key: int(n) * (1024 * 1024 if mib else 1) for key, n, mib in found}
    defaults = {"max_count": 2000, "max_bytes": 256 * 1024 * 1024, "per_device": 200}
    assert stated == defaults
    assert example["samples"] == defaults
    assert ControllerConfig.model_validate(example).samples.model_dump() == defaults


def test_a_database_url_carrying_a_password_is_refused_naming_the_key(tmp_path: Path) -> None:
    password = secrets.token_urlsafe(12)
    path = tmp_path / "controller.yaml"
    path.write_text(f"unsigned: true\ndatabase: {{url: 'postgresql://fleet:{password}@db:5432/fleet'}}\n")
    with pytest.raises(ConfigError) as refused:
        load_controller_config(path)
    problems = " ".join(refused.value.problems)
    assert "database.url" in problems
    assert "put it in password_file" in problems
    assert password not in str(refused.value) + problems


def test_the_database_password_comes_from_its_file_and_the_controller_uses_it(
    tmp_path: Path, postgres: PostgresServer
) -> None:
    """A real PostgreSQL that asks for a password: the controller's store opens with the one in
    ``password_file``, a relative file is read from the config's directory, and a wrong one is refused
    without the password in the message."""
    name = postgres.new_database()
    shutil.copy(postgres.password_file, tmp_path / "db.password")
    (tmp_path / "db.password").chmod(0o600)
    path = tmp_path / "controller.yaml"
    path.write_text(
        f"unsigned: true\ndatabase: {{url: '{postgres.url(name)}', password_file: db.password}}\n"
    )
    config = load_controller_config(path)
    assert config.database.password_file == tmp_path / "db.password"
    store = PostgresRolloutStore(StateDatabase(conninfo_of(config.database)))
    assert store.open_rollouts() == []
    store.close()
    wrong = secrets.token_urlsafe(12)
    (tmp_path / "db.password").write_text(wrong + "\n")
    with pytest.raises(RolloutStoreError, match="password authentication failed") as refused:
        PostgresRolloutStore(StateDatabase(conninfo_of(load_controller_config(path).database)))
    assert wrong not in str(refused.value)
