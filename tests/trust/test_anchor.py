"""The device's kept root and what it reports: its telemetry's ``trust.*`` figures become the
controller's ``edge_trust_root_*`` series the alert rules watch (dashboards/edge-fleet-alerts.yml)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.errors import ConfigError
from agent.fleet.metrics.exposition import fleet_metrics
from agent.fleet.view.live import FleetView
from agent.protocol.messages import RootChain, TelemetryMessage, encode
from agent.protocol.topics import Topics
from agent.trust.anchor import FleetRoot
from tests.fleet.metrics.test_exposition import device, feed, find, samples
from tests.trust.fleet_keys import FleetKeys, in_days


def _anchor(tmp_path: Path, keys: FleetKeys, **root: object) -> FleetRoot:
    path = tmp_path / "1.root.json"
    path.write_bytes(keys.root(1, **root).to_bytes())  # type: ignore[arg-type]
    return FleetRoot(path, tmp_path / "state" / "root.json")


def test_an_expired_root_is_reported_and_becomes_the_series_the_alert_watches(tmp_path: Path) -> None:
    anchor = _anchor(tmp_path, FleetKeys(), expires=in_days(-1))
    stats = anchor.stats()
    assert stats["root_version"] == 1
    assert stats["root_expired"] == 1
    assert stats["root_expires_in_s"] < 0
    view = FleetView("fleet/v1")
    device(view, "jet-a", site="lab")
    telemetry = TelemetryMessage(**{f"trust.{k}": v for k, v in stats.items()})
    feed(view, Topics("fleet/v1", "jet-a").telemetry, encode(telemetry))
    got = samples(fleet_metrics(view))
    assert find(got, "edge_trust_root_expired", device="jet-a") == 1
    assert find(got, "edge_trust_root_version", device="jet-a") == 1
    assert (find(got, "edge_trust_root_expires_in_seconds", device="jet-a") or 0) < 0


def test_a_fresh_root_is_not_expired(tmp_path: Path) -> None:
    assert _anchor(tmp_path, FleetKeys(), expires=in_days(30)).stats()["root_expired"] == 0


def test_a_configured_root_its_own_keys_did_not_sign_stops_the_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not signed by a threshold of its own root keys"):
        _anchor(tmp_path, FleetKeys(), sign_with=1)


def test_a_chain_that_is_not_one_is_refused_and_the_root_stays(tmp_path: Path) -> None:
    keys = FleetKeys()
    anchor = _anchor(tmp_path, keys)
    assert [e.code for e in anchor.take(b"not json")] == ["bad_root"]
    assert [e.code for e in anchor.take(b'{"roots": [{"signed": {}}]}')] == ["bad_root"]
    two = RootChain(roots=[{"signed": {}}]).model_copy(update={"roots": []})
    assert [e.code for e in anchor.take(two.model_dump_json().encode())] == ["bad_root"]
    assert anchor.current().signed.version == 1
    assert not (tmp_path / "state" / "root.json").exists()


def test_a_taken_version_is_kept_and_wins_at_the_next_start(tmp_path: Path) -> None:
    keys = FleetKeys()
    anchor = _anchor(tmp_path, keys)
    chain = RootChain(roots=[keys.root(1).to_dict(), keys.root(2).to_dict()])
    assert anchor.take(chain.model_dump_json().encode()) == []
    again = FleetRoot(tmp_path / "1.root.json", tmp_path / "state" / "root.json")
    assert again.current().signed.version == 2
