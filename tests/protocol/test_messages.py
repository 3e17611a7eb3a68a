"""Message models: defaults, round trips, validation errors that say what was wrong."""

from __future__ import annotations

import math

import pytest
from pydantic import BaseModel

from agent.errors import AgentError
from agent.protocol.messages import (
    MESSAGE_MODELS,
    TERMINAL_JOB_STATES,
    CommandRequest,
    InfoMessage,
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


_JOB = b'"job_id": "j", "slot": "s", "state": "QUEUED"'
_REF = b'"model": {"slot": "s", "model_id": "m", "sha256": "ab"}'
_RESULT = b'"stream": "cam", "frame_index": 1, "captured_at": 1, "published_at": 1, "latency_ms": {}, ' + _REF


@pytest.mark.parametrize("number", [b"NaN", b"Infinity", b"-Infinity", b"1e400", b'"nan"', b'"-inf"'])
@pytest.mark.parametrize(
    ("model", "body"),
    [
        (StatusMessage, b'"state": "online", "session": 1, "agent_version": "x", "ts": %s'),
        (JobStatus, _JOB + b', "ts": %s'),
        (JobStatus, _JOB + b', "timings_s": {"download": %s}'),
        (TelemetryMessage, b'"ts": %s'),
        (ResultMessage, _RESULT.replace(b'"captured_at": 1', b'"captured_at": %s')),
        (ResultMessage, _RESULT.replace(b'"latency_ms": {}', b'"latency_ms": {"infer": %s}')),
        (InfoMessage, b'"device_id": "d", "agent_version": "x", "backends": {}, "streams": [], '
         b'"platform": {}, "slots": {"s": {"state": "EMPTY", "since": %s}}'),
    ],
    ids=[
        "status.ts", "job.ts", "job.timings_s", "telemetry.ts", "result.captured_at", "result.latency",
        "info.since",
    ],
)  # fmt: skip
def test_times_refuse_nan_infinity_and_overflow(model: type[BaseModel], body: bytes, number: bytes) -> None:
    assert decode(model, b"{" + body % b"1.5" + b"}")  # the same message with a finite time is fine
    with pytest.raises(ProtocolError, match="finite number"):
        decode(model, b"{" + body % number + b"}")


@pytest.mark.parametrize(
    ("model", "body", "field"),
    [
        (StatusMessage, b'"state": "online", "session": %s, "agent_version": "x"', "session"),
        (JobStatus, _JOB + b', "bytes_done": %s', "bytes_done"),
        (ResultMessage, _RESULT.replace(b'"frame_index": 1', b'"frame_index": %s'), "frame_index"),
    ],
)
def test_counts_fit_64_bits(model: type[BaseModel], body: bytes, field: str) -> None:
    assert decode(model, b"{" + body % str(2**63 - 1).encode() + b"}")
    for number in (str(2**63).encode(), b"1" + b"0" * 400, b"-1"):
        with pytest.raises(ProtocolError, match=field):
            decode(model, b"{" + body % number + b"}")


def test_a_telemetry_integer_too_large_for_a_float_is_refused_not_raised() -> None:
    with pytest.raises(ProtocolError, match="'x' must be finite"):
        decode(TelemetryMessage, b'{"ts": 1, "x": 1' + b"0" * 400 + b"}")


def test_a_nan_score_is_sent_as_null_and_read_back_as_nan() -> None:
    """A model gone bad (NaN outputs) still produces valid result messages: they show the breakage."""
    from agent.protocol.results import ClassScore

    sent = ClassScore(index=0, label="cat", score=float("nan")).model_dump_json()
    assert '"score":null' in sent
    back = ClassScore.model_validate_json(sent)
    assert math.isnan(back.score)
