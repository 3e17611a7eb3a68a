"""``--calibration`` and its ``--calib-*`` flags through the real argument parser: what the manifest
carries, each mistake named by its flag, and an INT8 build with no source of scales refused before
anything is sent (the broker address is a port nothing listens on)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from agent.cli import main
from agent.errors import UsageError
from agent.fleet.cli.deploy import check_int8_source, manifest_fields
from agent.fleet.cli.main import add_fleet_arguments
from agent.protocol.manifest import build_manifest
from tests.fleet.operator_side import tiny_model, unsigned_deploy

PROTOCOL_DOC = Path(__file__).resolve().parents[3] / "docs" / "protocol.md"
#: Port 9 (discard): nothing listens there, so reaching for the broker would fail otherwise.
NOWHERE = ["--broker", "127.0.0.1:9"]


def _fields(command: str, *flags: str) -> dict[str, object]:
    parser = argparse.ArgumentParser()
    add_fleet_arguments(parser)
    extra = ["start"] if command == "rollout" else []
    flags = (*flags, "--unsigned") if command == "deploy" else flags
    args = parser.parse_args([command, *extra, "m.onnx", "--slot", "cls", "--version", "2", *flags])
    return manifest_fields(args)


def _documented_build() -> dict[str, object]:
    """The one-line JSON example under protocol.md's sentence on ``--calibration stream``."""
    text = PROTOCOL_DOC.read_text()
    start = text.index("```json", text.index("--calibration stream --calib-frames 300")) + len("```json")
    return dict(json.loads(text[start : text.index("```", start)]))


@pytest.mark.parametrize("command", ["deploy", "rollout"])
def test_the_documented_flags_put_stream_calibration_in_the_signed_manifest(
    command: str, tmp_path: Path
) -> None:
    flags = [
        "--precision",
        "int8",
        "--calibration",
        "stream",
        "--calib-frames",
        "300",
        "--engine-device",
        "dla0",
    ]
    fields = _fields(command, *flags)
    manifest = build_manifest(
        tiny_model(tmp_path / "m.onnx"),
        job_id="j",
        sequence=1,
        slot="cls",
        model_id="m",
        version="2",
        build=fields["build"],  # type: ignore[arg-type]
    )
    sent = json.loads(manifest.model_dump_json(exclude_none=True))

    assert {"build": sent["build"]} == _documented_build()


def test_every_protocol_calibration_is_reachable_from_the_flags() -> None:
    stream = _fields("deploy", "--precision", "int8", "--calibration", "stream", "--calib-stream", "cam1")
    dataset = _fields(
        "rollout",
        "--precision",
        "best",
        "--calibration",
        "dataset",
        "--calib-dataset",
        "/data/calib",
        "--calib-frames",
        "64",
    )

    assert stream["build"].calibration.model_dump(exclude_none=True) == {  # type: ignore[attr-defined]
        "kind": "stream",
        "stream": "cam1",
        "frames": 200,
    }
    assert dataset["build"].calibration.model_dump(exclude_none=True) == {  # type: ignore[attr-defined]
        "kind": "dataset",
        "path": Path("/data/calib"),
        "frames": 64,
    }


def test_int8_without_any_source_of_scales_is_refused_before_anything_is_sent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny_model(tmp_path / "m.onnx")
    for start in (
        ["fleet", "deploy", str(model), "--device", "local-01", "--unsigned"],
        ["fleet", "rollout", "start", str(model), "--device", "local-01"],
    ):
        argv = [
            *start,
            "--slot",
            "shapes",
            "--version",
            "2",
            "--precision",
            "int8",
            "--engine-device",
            "dla0",
        ]
        assert main([*argv, *NOWHERE]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: --precision int8 needs a calibration source, and none is given"), err
        for flag in ("--calibration stream", "--calib-frames N", "--calib-dataset DIR", "--calib-cache FILE"):
            assert flag in err, err
        assert "127.0.0.1:9" not in err  # refused before the broker was reached for


def test_calibration_flag_mistakes_name_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tiny_model(tmp_path / "m.onnx")
    deploy = unsigned_deploy(model)
    cases = [
        (["--calibration", "stream"], "--calibration stream needs an INT8 build: add --precision int8"),
        (["--precision", "int8", "--calib-frames", "50"], "--calib-frames needs --calibration stream"),
        (
            ["--precision", "int8", "--calibration", "stream", "--calib-frames", "0"],
            "--calib-frames must be 1 to",
        ),
        (
            ["--precision", "int8", "--calibration", "dataset"],
            "--calibration dataset needs --calib-dataset DIR",
        ),
        (["--precision", "int8", "--calib-stream", "cam"], "--calib-stream needs --calibration stream"),
        (
            ["--precision", "int8", "--calibration", "stream", "--calib-dataset", "/d"],
            "--calib-dataset needs --calibration dataset",
        ),
        (
            ["--precision", "int8", "--calibration", "stream", "--calib-cache", str(model)],
            "--calibration and --calib-cache: give one of them",
        ),
    ]
    for extra, says in cases:
        assert main([*deploy, *extra, *NOWHERE]) == 1, extra
        err = capsys.readouterr().err
        assert err.startswith(f"error: {says}"), (extra, err)


def _qdq_model(path: Path) -> Path:
    """A model that carries its own INT8 scales: x -> QuantizeLinear -> DequantizeLinear -> y."""
    scale = numpy_helper.from_array(np.array(0.05, dtype=np.float32), "scale")
    zero = numpy_helper.from_array(np.array(0, dtype=np.int8), "zero")
    graph = helper.make_graph(
        [
            helper.make_node("QuantizeLinear", ["x", "scale", "zero"], ["q"]),
            helper.make_node("DequantizeLinear", ["q", "scale", "zero"], ["y"]),
        ],
        "qdq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 8, 8])],
        initializer=[scale, zero],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    return path


def test_a_qdq_model_needs_no_calibration_and_a_plain_one_does(tmp_path: Path) -> None:
    fields = _fields("deploy", "--precision", "int8")
    check_int8_source(fields, _qdq_model(tmp_path / "q.onnx"))  # its own scales: nothing to add
    with pytest.raises(UsageError, match="needs a calibration source"):
        check_int8_source(fields, tiny_model(tmp_path / "m.onnx"))
    check_int8_source(_fields("deploy", "--precision", "best"), tiny_model(tmp_path / "b.onnx"))


def test_build_json_carries_any_build_field_and_a_field_set_twice_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    documented = '{"workspace_mb": 2048, "devices": ["dla0", "dla1"], "fallback": "none"}'
    fields = _fields("rollout", "--build-json", documented, "--precision", "int8", "--calibration", "stream")
    build = fields["build"]
    sent = build.model_dump(mode="json", exclude_defaults=True)  # type: ignore[attr-defined]

    assert sent == {
        "precision": "int8",
        "devices": ["dla0", "dla1"],
        "workspace_mb": 2048,
        "calibration": {"kind": "stream"},
        "fallback": "none",
    }
    assert f"`'{documented}'`" in (PROTOCOL_DOC.parent / "fleet.md").read_text()
    model = tiny_model(tmp_path / "m.onnx")
    deploy = unsigned_deploy(model)
    cases = [
        (["--build-json", '{"precision": "fp16"}', "--precision", "int8"], "--precision and --build-json's"),
        (
            ["--build-json", '{"workspace_mb": 1}'],
            "--build-json workspace_mb: Input should be greater than or equal to 16",
        ),
        (["--build-json", "[1]"], "--build-json must be a JSON object"),
        (
            [
                "--build-json",
                '{"precision": "int8", "calibration": {"kind": "stream"}}',
                "--calib-cache",
                str(model),
            ],
            "--calib-cache and --build-json's 'calibration'",
        ),
    ]
    for extra, says in cases:
        assert main([*deploy, *extra, *NOWHERE]) == 1, extra
        err = capsys.readouterr().err
        assert err.startswith(f"error: {says}"), (extra, err)
    # --build-json's INT8 with its own calibration needs no flag; without one it is refused as INT8 is.
    check_int8_source(
        _fields("deploy", "--build-json", '{"precision": "int8", "calibration": {"kind": "stream"}}'), model
    )
    with pytest.raises(UsageError, match="needs a calibration source"):
        check_int8_source(_fields("deploy", "--build-json", '{"precision": "int8"}'), model)
