"""End to end: a way back never leads forward, and a finished rollout is rolled back in waves.

Real processes throughout: mosquitto, a real ``edge-agent fleet controller`` process signing with the
operator's key, real ``python -m agent run`` daemons serving the bundled shapes classifier, and the
operator's commands through ``agent.cli.main``. Versions 2 and 3 are the same network with their
own bytes (another ``doc_string``), so each is its own model to the controller and the devices. The
rollouts run with shadow and probation on, as operators run them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnx
import pytest

from agent.cli import main
from agent.datasets.shapes import MODEL_PATH
from agent.demo.broker import Broker
from agent.fleet.controller.client import ControllerClient
from agent.fsutil import sha256_file
from agent.protocol.topics import Topics
from agent.specs.build import BuildSpec
from tests.e2e.daemon import unique_results
from tests.e2e.fleet_rig import (
    ENDS_ONLY_PROBATION,
    Fleet,
    agent_state,
    count_version,
    ends_only_shadow,
    finish,
    job_statuses,
    operator_settings,
)
from tests.fleet.controller_process import ControllerProcess
from tests.mqtt_probe import Probe
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def controller(tmp_path: Path, broker: Broker, fleet: Fleet) -> Iterator[ControllerProcess]:
    (tmp_path / "controller").mkdir()
    running = ControllerProcess(tmp_path / "controller", broker, "fleet/v1", keys=fleet.keys).start()
    yield running
    running.kill()


def version_of(tmp_path: Path, version: str) -> Path:
    """The shapes classifier with bytes of its own for ``version`` (the same network)."""
    model = onnx.load(str(MODEL_PATH))
    model.doc_string = f"shapes classifier, version {version}"
    path = tmp_path / f"shapes-{version}.onnx"
    onnx.save(model, str(path))
    return path


def cli(broker: Broker, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``edge-agent fleet ARGS`` as the operator runs it: its exit code, stdout and stderr."""
    capsys.readouterr()
    code = main(["fleet", *args, "--broker", f"{broker.host}:{broker.port}"])
    printed = capsys.readouterr()
    return code, printed.out, printed.err


def rollout_status(broker: Broker, rollout_id: str) -> dict[str, Any]:
    with ControllerClient(operator_settings(broker), timeout=30) as client:
        return client.request("status", {"rollout_id": rollout_id})


def start(
    broker: Broker, model: Path, devices: list[str], rollout_id: str, version: str, **fields: Any
) -> None:
    """``fleet rollout start`` through the controller's API, guarded by shadow and probation."""
    body: dict[str, Any] = {
        "rollout_id": rollout_id,
        "model_sha256": sha256_file(model),
        "model_name": model.name,
        "model_id": "cls",
        "slot": "cls",
        "version": version,
        "devices": devices,
        "shadow": ends_only_shadow(frames=5, sample_fps=10.0).model_dump(mode="json"),
        "probation_s": 2.0,
        "probation": ENDS_ONLY_PROBATION.model_dump(mode="json"),
        **fields,
    }
    with ControllerClient(operator_settings(broker), timeout=30) as client:
        client.upload(model, body["model_sha256"])
        client.request("start", body)


def wait_state(broker: Broker, rollout_id: str, *states: str, timeout: float = 240) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def reached() -> bool:
        seen.update(rollout_status(broker, rollout_id))
        return seen["state"] in states

    wait_until(reached, timeout=timeout, what=f"rollout {rollout_id} in {states}")
    return seen


def serving(files: Any) -> str | None:
    """The version state.json says the device's slot serves."""
    active = agent_state(files)["slots"]["cls"]["active"]
    return None if active is None else str(active["version"])


def test_a_rollback_after_an_abort_with_rollback_never_turns_the_aborted_model_on(
    fleet: Fleet,
    controller: ControllerProcess,
    broker: Broker,
    probe: Probe,
    device_id: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    files = fleet.start_shapes(device_id)
    probe.wait_for(count_version("1", Topics("fleet/v1", device_id).results("cam")), timeout=180)
    start(broker, version_of(tmp_path, "3"), [device_id], "r-v3", "3")
    assert wait_state(broker, "r-v3", "DONE", "ABORTED")["state"] == "DONE"
    # v4 soaks after its one wave: the operator aborts it there and asks for the way back.
    start(broker, version_of(tmp_path, "4"), [device_id], "r-v4", "4", soak_s=3600.0)
    wait_state(broker, "r-v4", "RUNNING", timeout=60)
    wait_until(
        lambda: rollout_status(broker, "r-v4")["waves"][0]["state"] == "SOAKING",
        timeout=240,
        what="r-v4's wave soaking",
    )
    assert serving(files) == "4"
    code, _out, _err = cli(broker, capsys, "rollout", "abort", "r-v4", "--rollback")
    assert code == 0
    wait_until(
        lambda: (rollout_status(broker, "r-v4").get("rollback") or {}).get("ends") is not None,
        timeout=120,
        what="r-v4's rollback at its end",
    )
    assert serving(files) == "3"

    code, out, _err = cli(broker, capsys, "cmd", device_id, "rollback", "--args", '{"slot": "cls"}')
    reply = json.loads(out)
    # The way back was a rollback: the device does not take the aborted v4 for its last-known-good.
    assert code == 1, reply
    assert reply["error_code"] == "no_rollback_target", reply
    assert "already rolled back to cls 3" in reply["error"], reply
    assert serving(files) == "3"
    state = agent_state(files)["slots"]["cls"]
    assert state["active"]["origin"] == "rollback"
    assert state["last_known_good"] is None
    results = unique_results(probe.snapshot(), Topics("fleet/v1", device_id).results("cam"))
    assert "4" in {r.model.version for r in results}  # it did serve v4, and v3 again after it
    way_back = job_statuses(probe, f"r-v4-rollback-{sha256_file(tmp_path / 'shapes-3.onnx')[:8]}", device_id)
    assert [s.state.value for s in way_back if s.state.terminal] == ["ACTIVE"]


def test_a_finished_rollout_is_rolled_back_in_waves_every_device_once_across_a_controller_restart(
    fleet: Fleet,
    controller: ControllerProcess,
    broker: Broker,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    names = ["back-0", "back-1"]
    devices = {name: fleet.start_shapes(name) for name in names}
    with Probe(broker.host, broker.port) as probe:
        probe.subscribe("fleet/v1/+/up/#")
        for name in names:
            probe.wait_for(count_version("1", Topics("fleet/v1", name).results("cam")), timeout=180)
        start(broker, version_of(tmp_path, "2"), names, "r-v2", "2")
        assert wait_state(broker, "r-v2", "DONE", "ABORTED")["state"] == "DONE"
        start(broker, version_of(tmp_path, "3"), names, "r-v3", "3", waves="1,100%")
        assert wait_state(broker, "r-v3", "DONE", "ABORTED")["state"] == "DONE"
        assert {serving(files) for files in devices.values()} == {"3"}

        code, out, _err = cli(broker, capsys, "rollout", "rollback", "r-v3", "--soak", "15s")
        assert code == 0, out
        assert "rollout r-v3-rollback: RUNNING" in out
        assert "rolls back rollout r-v3" in out
        # Killed while the canary's wave soaks: the restarted controller carries on from its store.
        wait_until(
            lambda: rollout_status(broker, "r-v3-rollback")["waves"][0]["state"] == "SOAKING",
            timeout=120,
            what="the rollback's first wave soaking",
        )
        controller.kill()
        controller.start()
        ended = wait_state(broker, "r-v3-rollback", "DONE", "ABORTED")
        statuses = {name: job_statuses(probe, ended["job_id"], name) for name in names}
    assert ended["state"] == "DONE", ended
    assert [w["state"] for w in ended["waves"]] == ["DONE", "DONE"]  # the finished rollout's waves
    assert ended["devices"] == {"ACTIVE": 2}
    assert ended["rollback_of"] == "r-v3"
    assert ended["version"] == "2"
    assert rollout_status(broker, "r-v3")["rolled_back_by"] == ["r-v3-rollback"]
    for name, files in devices.items():
        # Every device ran the way back once: one job, queued once, ended once, on its v2 again.
        states = [s.state.value for s in statuses[name]]
        assert states.count("QUEUED") == 1, (name, states)
        assert {s for s in states if s in ("ACTIVE", "FAILED", "REJECTED", "ROLLED_BACK")} == {"ACTIVE"}
        assert serving(files) == "2"
        slot = agent_state(files)["slots"]["cls"]
        assert slot["active"]["origin"] == "rollback"
        assert slot["last_known_good"] is None
    # A second rollback of the same rollout is refused, naming the first.
    code, _out, err = cli(broker, capsys, "rollout", "rollback", "r-v3")
    assert code != 0
    assert "was rolled back already, by r-v3-rollback" in err
    # And a device's own rollback never goes forward to v3.
    code, out, _err = cli(broker, capsys, "cmd", names[0], "rollback", "--args", '{"slot": "cls"}')
    assert json.loads(out)["error_code"] == "no_rollback_target"
    assert serving(devices[names[0]]) == "2"


#: Frames the v2 engine calibrates on: at the stream's 30 fps, 15 s, which its rollback spends again.
CALIBRATION_FRAMES = 450


def test_a_rollback_slower_than_the_cli_timeout_is_followed_to_its_end_not_reported_as_no_reply(
    fleet: Fleet,
    broker: Broker,
    probe: Probe,
    device_id: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The way back to an INT8 engine calibrated on the device's own frames calibrates again (15 s of
    frames, then the build): past `fleet cmd`'s default 10 s --timeout. The device answers `running`
    within it and the final reply follows; the CLI waits for it."""
    files = fleet.start_shapes(device_id)
    probe.wait_for(count_version("1", Topics("fleet/v1", device_id).results("cam")), timeout=180)
    calibration = {"kind": "stream", "frames": CALIBRATION_FRAMES}
    build = BuildSpec.model_validate({"precision": "int8", "device": "cpu", "calibration": calibration})
    guarded = {"shadow": ends_only_shadow(frames=5), "probation_s": 2.0, "probation": ENDS_ONLY_PROBATION}
    v2_deploy = fleet.deploy(version_of(tmp_path, "2"), [device_id], "2", build=build, **guarded)
    v2 = finish(v2_deploy, timeout=180)
    assert v2.ok, v2.failures()
    v3 = finish(fleet.deploy(version_of(tmp_path, "3"), [device_id], "3", **guarded), timeout=120)
    assert v3.ok, v3.failures()
    assert serving(files) == "3"

    code, out, err = cli(broker, capsys, "cmd", device_id, "rollback", "--args", '{"slot": "cls"}')
    reply = json.loads(out)
    assert code == 0, (reply, err)
    assert reply["ok"] is True
    assert reply["result"]["model"]["version"] == "2"
    assert "state" not in reply["result"]  # the final reply, not the `running` one
    assert f"{device_id}: rollback running on the device; following it to its end" in err
    assert serving(files) == "2"
