"""dashboards/edge-fleet-alerts.yml: promtool checks the rules and runs their unit tests
(dashboards/edge-fleet-alerts.test.yml), every alert is unit-tested firing and not firing, and
alerts travel from a real Prometheus scraping a real controller, through a real Alertmanager
running dashboards/alertmanager.yml, to a webhook receiver (a local HTTP server), with their labels.
The devices are simulated (tests/fleet/metrics/scraped_fleet.py): there is no fleet of Jetsons here."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.demo.broker import Broker
from agent.fleet.metrics.exposition import fleet_metrics
from agent.fleet.rollout.records import OPERATOR_ABORT, RolloutPlan, RolloutState
from agent.fleet.view.live import FleetView
from agent.protocol.messages import JobState, JobStatus, encode
from tests.alertmanager_server import Alertmanager, WebhookReceiver, alertmanager_binary
from tests.fleet.metrics.scraped_fleet import ScrapedFleet
from tests.prometheus_server import Prometheus
from tests.waiting import patient, wait_until

REPO = Path(__file__).resolve().parents[3]
RULES = REPO / "dashboards" / "edge-fleet-alerts.yml"
RULE_TESTS = REPO / "dashboards" / "edge-fleet-alerts.test.yml"
ALERTMANAGER_EXAMPLE = REPO / "dashboards" / "alertmanager.yml"
#: The webhook URL of the example, replaced by the test receiver's (nothing else is changed).
EXAMPLE_URL = "http://alert-receiver.example.com:9095/edge-fleet"
#: A series selector of the controller's: a metric name and its matchers, if any.
SELECTOR = re.compile(r"\bedge_[a-z0-9_]+(?:\{[^}]*\})?")


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed: run tools/os-deps.sh test (make os-deps)")
    return found


def _run(*command: str) -> None:
    """Run a checker in the rules' directory (the test file names its rule file relatively)."""
    done = subprocess.run(
        command, cwd=RULES.parent, capture_output=True, text=True, timeout=patient(120), check=False
    )
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}{done.stderr}"


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_promtool_checks_the_rules() -> None:
    _run(_tool("promtool"), "check", "rules", RULES.name)


def test_the_rules_pass_their_promtool_unit_tests() -> None:
    _run(_tool("promtool"), "test", "rules", RULE_TESTS.name)


def test_every_alert_is_unit_tested_firing_and_not_firing() -> None:
    doc = yaml.safe_load(RULE_TESTS.read_text(encoding="utf-8"))
    fires: set[str] = set()
    quiet: set[str] = set()
    for test in doc["tests"]:
        for case in test["alert_rule_test"]:
            (fires if case["exp_alerts"] else quiet).add(case["alertname"])
    names = {rule["alert"] for rule in _rules()}
    assert names == fires, f"never seen firing: {names - fires}"
    assert names == quiet, f"never seen quiet: {names - quiet}"


def test_the_series_the_absent_alert_watches_is_there_before_any_device() -> None:
    [rule] = [r for r in _rules() if r["alert"] == "EdgeFleetMetricsAbsent"]
    [watched] = re.findall(r"absent\((\w+)\)", rule["expr"])
    text = fleet_metrics(FleetView("fleet/v1")).render().decode()
    assert watched in [line.split()[0] for line in text.splitlines() if not line.startswith("#")]


def test_amtool_checks_the_alertmanager_example() -> None:
    alertmanager_binary()  # the same package ships amtool
    _run(_tool("amtool"), "check-config", str(ALERTMANAGER_EXAMPLE))


def _alerts_section() -> str:
    text = (REPO / "docs" / "operations.md").read_text(encoding="utf-8")
    return text.split("\n## Alerts\n", 1)[1].split("\n## ", 1)[0]


def test_the_documented_prometheus_config_loads_the_rules(tmp_path: Path) -> None:
    snippet = _alerts_section().split("```yaml\n", 1)[1].split("```", 1)[0]
    documented = "/etc/prometheus/edge-fleet-alerts.yml"
    assert documented in snippet
    config = tmp_path / "prometheus.yml"
    config.write_text(snippet.replace(documented, str(RULES)), encoding="utf-8")
    done = subprocess.run(
        [_tool("promtool"), "check", "config", str(config)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in done.stdout


def test_the_documented_table_lists_every_alert_with_its_for() -> None:
    rows = {}
    for line in _alerts_section().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        found = re.fullmatch(r"`(Edge\w+)`.*", cells[0]) if line.startswith("| `Edge") else None
        if found:
            rows[found.group(1)] = cells[2]
    rules = {rule["alert"]: rule.get("for", "none") for rule in _rules()}
    assert set(rows) == set(rules)
    for name, duration in rules.items():
        assert rows[name].split()[0] == duration, (
            f"{name}: the doc says {rows[name]!r}, the rule {duration!r}"
        )


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    server = WebhookReceiver()
    yield server
    server.stop()


@pytest.fixture
def alertmanager(tmp_path: Path, receiver: WebhookReceiver) -> Iterator[Alertmanager]:
    text = ALERTMANAGER_EXAMPLE.read_text(encoding="utf-8")
    assert text.count(EXAMPLE_URL) == 1
    server = Alertmanager(tmp_path / "alertmanager", text.replace(EXAMPLE_URL, receiver.url))
    yield server
    server.stop()


@pytest.fixture
def fleet(broker: Broker, tmp_path: Path, alertmanager: Alertmanager) -> Iterator[ScrapedFleet]:
    # The rules as they are, but EdgeDeviceOffline without its 5 minutes of `for:` (a test cannot
    # wait them out); the other two alerts triggered here have no `for:`, and the rest keep theirs
    # so they cannot fire while the fleet starts.
    doc = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    for group in doc["groups"]:
        for rule in group["rules"]:
            if rule["alert"] == "EdgeDeviceOffline":
                rule["for"] = "0s"
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump(doc), encoding="utf-8")
    scraped = ScrapedFleet(
        broker,
        tmp_path,
        {"jet-a": "lab", "jet-b": "yard"},
        rule_files=[rules],
        alertmanagers=[alertmanager.address],
    )
    yield scraped
    scraped.close()


def _series(prom: Prometheus, selector: str) -> list[dict[str, Any]]:
    """The selector's series, waited for: on a loaded machine a device's telemetry may lapse past
    stale_after_s (3 s here) for a moment, and its series with it."""
    found: list[dict[str, Any]] = []

    def some() -> bool:
        found[:] = prom.query(selector)
        return bool(found)

    wait_until(some, timeout=60, what=f"series of {selector} on the controller's /metrics")
    return found


def _by_name(alerts: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The firing alerts by name (each name fires for one device or rollout here)."""
    return {a["labels"]["alertname"]: a for a in alerts if a["status"] == "firing"}


@pytest.mark.slow
def test_alerts_reach_the_webhook_through_a_real_alertmanager(
    fleet: ScrapedFleet, receiver: WebhookReceiver
) -> None:
    prom = fleet.prometheus
    wait_until(
        lambda: len(prom.query("edge_stream_frames_per_second")) == 2, timeout=60, what="fleet scraped"
    )
    # Every selector of every rule names series and labels the real controller exports: once the
    # three conditions below hold, each returns series carrying what the annotations print.
    fleet.devices["jet-b"].go_offline()
    fleet.store.set_state("r-1", RolloutState.ABORTED, "health gate tripped")
    # r-2 runs on (the stalled alert's series; it moved just now), r-3 its operator aborted.
    devices = list(fleet.devices)
    fleet.store.create(RolloutPlan("r-3", "main", "job-r-3", "6", waves=[devices]))
    fleet.store.set_state("r-3", RolloutState.ABORTED, OPERATOR_ABORT)
    fleet.store.create(RolloutPlan("r-2", "main", "job-r-2", "6", waves=[devices]))
    jet_a = fleet.devices["jet-a"]
    rolled_back = JobStatus(
        job_id="job-jet-a-2", slot="main", state=JobState.ROLLED_BACK, error_code="unhealthy"
    )
    jet_a.probe.publish(jet_a.topics.jobs(rolled_back.job_id), encode(rolled_back))

    expected = {
        "EdgeDeviceOffline",
        "EdgeRolloutAborted",
        "EdgeRolloutAbortedByOperator",
        "EdgeModelRolledBack",
    }
    wait_until(
        lambda: set(_by_name(receiver.alerts())) >= expected,
        timeout=120,
        what=f"{sorted(expected)} at the webhook",
    )
    instance = {"job": "edge", "instance": f"127.0.0.1:{fleet.controller.config.http.port}"}
    got = _by_name(receiver.alerts())
    assert set(got) == expected  # nothing else fired: jet-a online, spool, fps, heat all fine
    assert got["EdgeDeviceOffline"]["labels"] == {
        "alertname": "EdgeDeviceOffline",
        "device": "jet-b",
        "severity": "warning",
        **instance,
    }
    assert got["EdgeDeviceOffline"]["annotations"]["summary"] == "jet-b has been offline for 5 minutes"
    assert got["EdgeRolloutAborted"]["labels"] == {
        "alertname": "EdgeRolloutAborted",
        "rollout_id": "r-1",
        "slot": "main",
        "to_version": "5",
        "state": "ABORTED",
        "severity": "critical",
        **instance,
    }
    # The operator's own abort is a note (severity info), the gate's a page: r-1 alone is critical.
    assert got["EdgeRolloutAbortedByOperator"]["labels"] == {
        "alertname": "EdgeRolloutAbortedByOperator",
        "rollout_id": "r-3",
        "slot": "main",
        "to_version": "6",
        "state": "ABORTED",
        "severity": "info",
        **instance,
    }
    assert got["EdgeModelRolledBack"]["labels"] == {
        "alertname": "EdgeModelRolledBack",
        "device": "jet-a",
        "slot": "main",
        "job_id": "job-jet-a-2",
        "state": "ROLLED_BACK",
        "error_code": "unhealthy",
        "severity": "warning",
        **instance,
    }
    assert all(post["receiver"] == "fleet-webhook" for post in receiver.posts)

    for rule in _rules():
        printed = set(re.findall(r"\$labels\.(\w+)", " ".join(rule["annotations"].values())))
        for selector in SELECTOR.findall(rule["expr"]):
            found = _series(prom, selector)
            missing = {label for label in printed if label not in found[0]["metric"]}
            assert not missing, f"{rule['alert']}: {selector} has no label {missing}"
