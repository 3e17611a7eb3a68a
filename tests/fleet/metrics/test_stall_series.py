"""``/metrics``' series for seeing and clearing a stall: each wave's start and end, when a rollout last
moved, who aborted it, and the engines and build claims of the controller's real engine desk (a real
rollout store on disk, a real desk; the exposition parsed by ``prometheus_client``'s parser)."""

from __future__ import annotations

from pathlib import Path

from agent.fleet.controller.web import engine_figures
from agent.fleet.engines.settings import EngineShareSettings
from agent.fleet.metrics.exposition import fleet_metrics
from agent.fleet.rollout.records import OPERATOR_ABORT, RolloutPlan, RolloutState, WaveState
from agent.fleet.rollout.store import RolloutStore
from agent.fleet.view.live import FleetView
from agent.protocol.engines import EngineAsk
from agent.signing import Ed25519PrivateKey
from tests.engines.fleet_desk import make_desk
from tests.fleet.engines.records import store_engine
from tests.fleet.metrics.test_exposition import PREFIX, find, samples


def test_wave_times_last_change_and_who_aborted_are_series(tmp_path: Path) -> None:
    clock = [1000.0]
    store = RolloutStore(tmp_path / "rollouts.sqlite", clock=lambda: clock[0])
    store.create(RolloutPlan("r1", "main", "job-r1", "5", waves=[["jet-a"], ["jet-b"]]))
    store.create(RolloutPlan("r2", "aux", "job-r2", "2", waves=[["jet-a"]]))
    store.create(RolloutPlan("r3", "cam", "job-r3", "9", waves=[["jet-c"]]))
    clock[0] = 1010.0
    store.set_wave("r1", 0, WaveState.RUNNING)
    clock[0] = 1070.0
    store.mark_sending("r1", "jet-a")
    clock[0] = 1100.0
    store.set_state("r2", RolloutState.ABORTED, OPERATOR_ABORT)
    store.set_state("r3", RolloutState.ABORTED, "wave 1 tripped: 1 failed of 1 (max-failed 0)")
    metrics = fleet_metrics(
        FleetView(PREFIX),
        lambda: [store.rollout(r) for r in ("r1", "r2", "r3")],
        store.device_counts,
        store.change_mark,
        rollout_waves=store.wave_rows,
        rollout_changed=store.last_change,
    )
    got = samples(metrics)
    assert find(got, "edge_rollout_wave_started_timestamp_seconds", rollout_id="r1", wave="1") == 1010.0
    assert find(got, "edge_rollout_wave_started_timestamp_seconds", rollout_id="r1", wave="2") is None
    assert find(got, "edge_rollout_wave_ended_timestamp_seconds", rollout_id="r1") is None
    assert find(got, "edge_rollout_last_change_timestamp_seconds", rollout_id="r1", slot="main") == 1070.0
    assert find(got, "edge_rollout_aborted_info", rollout_id="r2", by="operator", slot="aux") == 1
    assert find(got, "edge_rollout_aborted_info", rollout_id="r3", by="gate") == 1
    assert find(got, "edge_rollout_aborted_info", rollout_id="r1") is None  # running
    clock[0] = 1200.0
    store.set_wave("r1", 0, WaveState.SOAKING)
    store.set_wave("r1", 0, WaveState.DONE)
    got = samples(metrics)
    assert find(got, "edge_rollout_wave_ended_timestamp_seconds", rollout_id="r1", wave="1") == 1200.0
    assert find(got, "edge_rollout_last_change_timestamp_seconds", rollout_id="r1") == 1200.0
    store.close()


def test_engines_and_build_claims_are_series_with_bounded_labels(tmp_path: Path) -> None:
    desk = make_desk(tmp_path, Ed25519PrivateKey.generate(), settings=EngineShareSettings())
    store_engine(desk, "jet-01", b"engine bytes")
    for device in ("jet-02", "jet-03", "jet-04"):
        desk.handle(device, "ask", EngineAsk(key="ab" * 32, job_id="j").model_dump_json().encode(), {})
    desk.handle("jet-05", "ask", EngineAsk(key="cd" * 32, job_id="j").model_dump_json().encode(), {})
    desk.release("cdcdcdcd", "stuck")
    metrics = fleet_metrics(FleetView(PREFIX), engines=lambda: engine_figures(desk))
    got = samples(metrics)
    assert find(got, "edge_engines_stored") == 1
    assert find(got, "edge_engines_stored_bytes") == len(b"engine bytes")
    assert find(got, "edge_engines_withdrawn") == 0
    assert find(got, "edge_engine_claims") == 1
    assert find(got, "edge_engine_claim_waiting_devices") == 2
    age = find(got, "edge_engine_claim_oldest_age_seconds")
    assert age is not None
    assert 0 <= age < 60
    assert find(got, "edge_engine_claims_ended_total", why="operator") == 1
    assert find(got, "edge_engine_claims_ended_total", why="released") == 0
    # No key, no device in any label: a fleet of any size has these few series.
    names = {name for name, _labels in got if "engine" in name}
    labels = {label for name, ls in got if "engine" in name for label, _v in ls}
    assert labels == {"why"}
    assert len([1 for name, _labels in got if "engine" in name]) == 6 + 5, names
