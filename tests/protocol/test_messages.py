"""Message models: defaults, round trips, validation errors that say what was wrong."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from agent.errors import AgentError
from agent.protocol.messages import (
    MESSAGE_MODELS,
    TERMINAL_JOB_STATES,
    CommandRequest,
    JobState,
    JobStatus,
    ProtocolError,
    ResultMessage,
    StatusMessage,
    TelemetryMessage,
    decode,
    encode,
)
from tests.protocol.examples import EXAMPLES


@pytest.mark.parametrize("model", MESSAGE_MODELS, ids=lambda m: m.__name__)
def test_round_trip(model: type[BaseModel]) -> None:
    message = EXAMPLES[model.__name__]
    assert decode(model, encode(message)) == message


def test_envelope_defaults_are_unique_and_encoding_is_compact() -> None:
    a = StatusMessage(state="online", session=1, agent_version="x")
    b = StatusMessage(state="online", session=1, agent_version="x")
    assert a.msg_id != b.msg_id
    assert len(a.msg_id) == 32
    assert a.ts > 1.7e9
    job = JobStatus(job_id="j", slot="s", state=JobState.QUEUED)
    data = encode(job)
    assert b" " not in data
    assert b"null" not in data
    assert decode(JobStatus, data) == job


def test_command_request_accepts_a_bare_payload() -> None:
    assert decode(CommandRequest, b"{}").args == {}


def test_terminal_states() -> None:
    assert {s for s in JobState if s.terminal} == TERMINAL_JOB_STATES
    assert JobState.ACTIVE.terminal
    assert JobState.FAILED.terminal
    assert not JobState.BUILDING.terminal


def test_telemetry_accepts_numbers_only() -> None:
    t = decode(TelemetryMessage, b'{"ts": 1.5, "fps": 30, "temp_c": 51.5}')
    assert t.fields() == {"fps": 30.0, "temp_c": 51.5}
    for bad, why in [
        (b'{"ts": 1, "gpu": "orin"}', "must be a number"),
        (b'{"ts": 1, "ok": true}', "must be a number"),
        (b'{"ts": 1, "nested": {"a": 1}}', "must be a number"),
        (b'{"ts": 1, "big": 1e999}', "must be finite"),
    ]:
        with pytest.raises(ProtocolError, match=why):
            decode(TelemetryMessage, bad)


def test_decode_errors_name_the_problem() -> None:
    with pytest.raises(ProtocolError, match="not valid JSON") as malformed:
        decode(JobStatus, b'{"job_id": ')
    assert isinstance(malformed.value, AgentError)
    assert malformed.value.code == "bad_message"
    with pytest.raises(ProtocolError, match="must be a JSON object"):
        decode(JobStatus, b"[1, 2]")
    with pytest.raises(ProtocolError, match=r"wrong shape: .*state: Input should be"):
        decode(JobStatus, b'{"job_id": "j", "slot": "s", "state": "DANCING"}')
    with pytest.raises(ProtocolError, match=r"model\.sha256: Field required"):
        decode(
            ResultMessage,
            b'{"stream":"c","frame_index":0,"captured_at":0,"published_at":0,'
            b'"model":{"slot":"s","model_id":"m"},"latency_ms":{}}',
        )
    with pytest.raises(ProtocolError, match="extra: Extra inputs are not permitted"):
        decode(StatusMessage, b'{"state":"online","session":1,"agent_version":"x","extra":1}')
