"""docs/enrollment.md's device sections say what the code does: its agent.yaml loads as written,
and the defaults it quotes are the models' defaults."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agent.config import load_config
from agent.enrollment.settings import EnrollmentSettings, RenewalSettings

DOC = Path(__file__).resolve().parents[2] / "docs" / "enrollment.md"


def _section(heading: str) -> str:
    return DOC.read_text().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_the_documented_agent_yaml_loads_with_only_the_claim_and_the_trust_anchors_in_place(
    tmp_path: Path,
) -> None:
    block = re.search(r"```yaml\n(.*?)```", _section("The device's side"), re.S)
    assert block is not None
    for name in ("ca.crt", "claim.crt", "claim.key"):
        (tmp_path / "tls").mkdir(exist_ok=True)
        (tmp_path / "tls" / name).write_text("")
    config_file = tmp_path / "agent.yaml"
    config_file.write_text(block.group(1))
    config = load_config(config_file, {})
    assert config.enrollment is not None
    assert config.enrollment.claim_key_file == tmp_path / "tls" / "claim.key"
    assert config.mqtt.tls is not None
    assert config.mqtt.tls.cert_file == Path("/var/lib/edge-agent/tls/device.crt")  # under state_dir
    assert config.mqtt.tls.cert_file.is_relative_to(config.state_dir)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("enrollment.reply_timeout_s", EnrollmentSettings.model_fields["reply_timeout_s"].default),
        ("enrollment.retry_min_s", EnrollmentSettings.model_fields["retry_min_s"].default),
        ("enrollment.retry_max_s", EnrollmentSettings.model_fields["retry_max_s"].default),
        ("renewal.reply_timeout_s", RenewalSettings.model_fields["reply_timeout_s"].default),
        ("renewal.retry_min_s", RenewalSettings.model_fields["retry_min_s"].default),
        ("renewal.retry_max_s", RenewalSettings.model_fields["retry_max_s"].default),
    ],
)
def test_the_quoted_defaults_are_the_models(key: str, value: float) -> None:
    prose = " ".join(DOC.read_text().split())  # the doc wraps lines anywhere
    assert re.search(rf"`{re.escape(key)}`,? \(?{value:g} s\b", prose), f"{key} ({value:g} s)"


def test_renewal_is_due_at_the_documented_two_thirds() -> None:
    assert RenewalSettings().at_fraction == pytest.approx(2 / 3)
    assert "`renewal.at_fraction` (2/3)" in DOC.read_text()
