"""What a slot really runs, read from an engine build's effective report (agent/protocol/runs.py)."""

from __future__ import annotations

from agent.protocol.runs import FALLBACK_CHARS, interim_runs, runs_of


def test_an_engine_running_what_was_asked_has_no_fallback_and_says_where_it_came_from() -> None:
    built = {"precision": "int8", "requested": {"precision": "int8", "device": "cpu"}}
    assert runs_of(built).model_dump(exclude_none=True) == {
        "requested": "int8",
        "precision": "int8",
        "source": "built",
    }
    downloaded = {**built, "engine_source": {"origin": "downloaded", "key": "ab12"}}
    assert runs_of(downloaded).source == "downloaded"
    cached = {**built, "engine_source": {"origin": "cache"}}
    assert runs_of(cached).source == "built"
    # best lets the planner choose: whatever it chose is what was asked.
    best = {"precision": "fp16", "requested": {"precision": "best"}}
    assert runs_of(best).fallback is None


def test_a_model_as_given_and_an_interim_model_are_no_fallback() -> None:
    as_given = runs_of({"backend": "onnxruntime", "precision": "fp32", "device": "cpu"})
    assert as_given.model_dump(exclude_none=True) == {"source": "model"}
    assert runs_of(None).model_dump(exclude_none=True) == {"source": "model"}
    assert interim_runs("int8").model_dump(exclude_none=True) == {"requested": "int8", "source": "interim"}


def test_a_fallback_names_the_guard_then_the_plan_then_the_backend() -> None:
    effective = {
        "precision": "fp32",
        "requested": {"precision": "int8"},
        "int8_guard": {"passed": False, "reason": "agreement 18.8% below the required 97.0%"},
        "changes": [
            {"field": "device", "requested": "gpu", "effective": "cpu", "reason": "no GPU here"},
            {
                "field": "precision",
                "requested": "fp16",
                "effective": "fp32",
                "reason": "ONNX Runtime runs FP32 on the CPU",
            },
        ],
        "fallback": {"from": "tensorrt", "to": "onnxruntime", "reason": "parser error"},
    }
    assert runs_of(effective).fallback == (
        "INT8 accuracy guard: agreement 18.8% below the required 97.0%; ONNX Runtime runs FP32 on the CPU; "
        "tensorrt -> onnxruntime: parser error"
    )
    # A report that says no more than the two precisions still says they differ.
    assert (
        runs_of({"precision": "fp16", "requested": {"precision": "fp32"}}).fallback
        == "fp32 asked, fp16 built"
    )
    # A device's words are cut to a known size before they leave it.
    long = {**effective, "int8_guard": {"passed": False, "reason": "x" * 10_000}}
    assert len(runs_of(long).fallback or "") == FALLBACK_CHARS
