"""The persisted state file: round trips, activation bookkeeping, corrupt files set aside."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from structlog.testing import capture_logs

from agent.state.file import (
    STATE_FILE_NAME,
    AgentState,
    ModelRecord,
    SlotState,
    StateFile,
    record_activation,
    record_rollback,
)


def _record(char: str, version: str = "1") -> ModelRecord:
    return ModelRecord(
        model_id=f"model-{char}",
        version=version,
        sha256=char * 64,
        path=f"/var/lib/edge-agent/models/{char * 64}.onnx",
        backend="onnxruntime",
        activated_at=datetime(2024, 5, 1, 12, 0, tzinfo=timezone.utc),
    )


def test_missing_file_is_empty_state(tmp_path: Path) -> None:
    state = StateFile(tmp_path / "state.json").load()
    assert state == AgentState()
    assert state.slots == {}
    assert state.slot("cls") == SlotState()


def test_save_then_load_round_trips_and_creates_the_directory(tmp_path: Path) -> None:
    state_file = StateFile.in_dir(tmp_path / "var" / "edge-agent")
    assert state_file.path == tmp_path / "var" / "edge-agent" / STATE_FILE_NAME
    state = record_activation(AgentState(), "cls", _record("a"))
    state = record_activation(state, "cls", _record("b", "2"))
    state_file.save(state)

    assert StateFile(state_file.path).load() == state
    on_disk = json.loads(state_file.path.read_text())
    assert on_disk["schema_version"] == 1
    assert on_disk["slots"]["cls"]["active"]["sha256"] == "b" * 64
    assert on_disk["slots"]["cls"]["last_known_good"]["model_id"] == "model-a"
    assert on_disk["slots"]["cls"]["active"]["activated_at"].startswith("2024-05-01T12:00:00")
    assert [p.name for p in state_file.path.parent.iterdir()] == [STATE_FILE_NAME]


def test_record_activation_moves_previous_to_last_known_good() -> None:
    empty = AgentState()
    first = record_activation(empty, "cls", _record("a"))
    assert first.slot("cls").active == _record("a")
    assert first.slot("cls").last_known_good is None
    assert empty.slots == {}, "record_activation must not modify its input"

    second = record_activation(first, "cls", _record("b"))
    assert second.slot("cls").active == _record("b")
    assert second.slot("cls").last_known_good == _record("a")
    assert first.slot("cls").active == _record("a")

    third = record_activation(second, "cls", _record("c"))
    assert third.slot("cls").last_known_good == _record("b")


def test_reactivating_the_same_model_keeps_last_known_good() -> None:
    state = record_activation(AgentState(), "cls", _record("a"))
    state = record_activation(state, "cls", _record("b"))
    # A restart restoring it: a new activation time, its origin and file path may differ.
    restored = _record("b").model_copy(
        update={"activated_at": datetime(2024, 6, 1, tzinfo=timezone.utc), "path": "/etc/b.onnx"}
    )
    again = record_activation(state, "cls", restored)
    assert again.slot("cls").active == restored
    assert again.slot("cls").last_known_good == _record("a")


def test_the_same_bytes_under_a_new_version_make_the_old_version_the_rollback_target() -> None:
    """Issue 20.13: v1 ran, then its bytes were deployed as v2; a rollback must find v1."""
    state = record_activation(AgentState(), "cls", _record("a", version="1"))
    state = record_activation(state, "cls", _record("a", version="2"))
    assert state.slot("cls").active == _record("a", version="2")
    assert state.slot("cls").last_known_good == _record("a", version="1")
    relabelled = _record("a", version="2").model_copy(update={"postprocess": {"labels": ["x", "y"]}})
    state = record_activation(state, "cls", relabelled)
    assert state.slot("cls").last_known_good == _record("a", version="2")


def test_a_rollback_leaves_no_target_so_a_second_one_cannot_swap_forward() -> None:
    state = record_activation(AgentState(), "cls", _record("a"))
    state = record_activation(state, "cls", _record("b"))
    back = record_rollback(state, "cls", _record("a"))
    assert back.slot("cls").active == _record("a")
    assert back.slot("cls").last_known_good is None
    # The next activation makes the rolled-back-to model the rollback target again.
    onward = record_activation(back, "cls", _record("c"))
    assert onward.slot("cls").last_known_good == _record("a")


def test_a_way_back_to_the_model_the_slot_serves_already_keeps_its_rollback_target() -> None:
    """A rollout's way back reaches a device that never ran the newer model: nothing was left."""
    state = record_activation(AgentState(), "cls", _record("a"))
    state = record_activation(state, "cls", _record("b"))
    again = record_rollback(state, "cls", _record("b", "1").model_copy(update={"origin": "rollback"}))
    assert again.slot("cls").last_known_good == _record("a")


def test_slots_are_independent() -> None:
    state = record_activation(AgentState(), "cls", _record("a"))
    state = record_activation(state, "det", _record("d"))
    state = record_activation(state, "det", _record("e"))
    assert state.slot("cls") == SlotState(active=_record("a"), last_known_good=None)
    assert state.slot("det").last_known_good == _record("d")


def test_activated_at_defaults_to_now_utc() -> None:
    before = datetime.now(timezone.utc)
    record = ModelRecord(model_id="m", sha256="0" * 64, path="/m.onnx", backend="onnxruntime")
    assert record.activated_at.tzinfo is not None
    assert before <= record.activated_at <= datetime.now(timezone.utc)


def _assert_set_aside(tmp_path: Path, bad: bytes) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(bad)
    with capture_logs() as logs:
        state = StateFile(path).load()
    assert state == AgentState()
    assert not path.exists()
    aside = list(tmp_path.glob("state.json.corrupt-*"))
    assert len(aside) == 1
    assert aside[0].read_bytes() == bad, "the corrupt file must be kept for inspection"
    events = [e for e in logs if e["event"] == "state.corrupt"]
    assert len(events) == 1
    assert events[0]["log_level"] == "error"
    assert events[0]["moved_to"] == str(aside[0])


def test_truncated_json_is_set_aside(tmp_path: Path) -> None:
    _assert_set_aside(tmp_path, b'{"schema_version": 1, "slots": {"cls": {"act')


def test_json_of_the_wrong_shape_is_set_aside(tmp_path: Path) -> None:
    _assert_set_aside(tmp_path, b'["not", "an", "object"]')


def test_invalid_record_is_set_aside(tmp_path: Path) -> None:
    bad = {"slots": {"cls": {"active": {"model_id": "m", "sha256": "short", "path": "/m", "backend": "x"}}}}
    _assert_set_aside(tmp_path, json.dumps(bad).encode())


def test_binary_garbage_is_set_aside(tmp_path: Path) -> None:
    _assert_set_aside(tmp_path, b"\xff\xfe\x00garbage")


def test_save_after_corruption_writes_a_good_file(tmp_path: Path) -> None:
    state_file = StateFile(tmp_path / "state.json")
    state_file.path.write_text("{")
    with capture_logs():
        state = state_file.load()
    state_file.save(record_activation(state, "cls", _record("a")))
    assert state_file.load().slot("cls").active == _record("a")


def test_repeated_corruption_never_overwrites_an_earlier_copy(tmp_path: Path) -> None:
    state_file = StateFile(tmp_path / "state.json")
    with capture_logs():
        for i in range(3):
            state_file.path.write_text(f"corrupt {i}")
            assert state_file.load() == AgentState()
    kept = sorted(p.read_text() for p in tmp_path.glob("state.json.corrupt-*"))
    assert kept == ["corrupt 0", "corrupt 1", "corrupt 2"]


def test_unreadable_state_path_does_not_crash(tmp_path: Path) -> None:
    (tmp_path / "state.json").mkdir()  # reading a directory fails with an OSError
    with capture_logs() as logs:
        assert StateFile(tmp_path / "state.json").load() == AgentState()
    assert [e["event"] for e in logs] == ["state.corrupt"]
    assert "unreadable" in logs[0]["reason"]


def test_unknown_keys_from_a_newer_agent_are_ignored(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    record = _record("a").model_dump(mode="json") | {"accelerator_profile": "future-field"}
    path.write_text(json.dumps({"schema_version": 2, "future": True, "slots": {"cls": {"active": record}}}))
    state = StateFile(path).load()
    assert state.slot("cls").active == _record("a")
    assert path.exists()
