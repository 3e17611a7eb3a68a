"""``--calib-cache FILE`` through the real argument parser: mistakes named, nothing sent, the request."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from agent.cli import main
from agent.fleet.cli.deploy import manifest_fields
from agent.fleet.cli.main import add_fleet_arguments
from agent.fleet.rollout.spec import RolloutRequest
from agent.fsutil import sha256_file
from agent.model_contract.calibration_table import write_table
from tests.fleet.operator_side import tiny_model, unsigned_deploy


def test_calib_cache_mistakes_name_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tiny_model(tmp_path / "m.onnx")
    (tmp_path / "labels.txt").write_text("cat\n")
    write_table(tmp_path / "calibration.json", {"x": (-1.0, 1.0)}, method="entropy")
    deploy = unsigned_deploy(model)
    cases = [
        (["--calib-cache", str(tmp_path / "nope.json"), "--precision", "int8"], "is not a file"),
        (["--calib-cache", str(tmp_path / "calibration.json")], "needs an INT8 build: add --precision int8"),
        (
            ["--calib-cache", str(tmp_path / "labels.txt"), "--precision", "int8"],
            "labels.txt is neither an edge-agent calibration table nor a TensorRT calibration cache",
        ),
    ]
    for extra, says in cases:
        assert main([*deploy, *extra]) == 1, extra
        err = capsys.readouterr().err
        assert err.startswith("error: --calib-cache"), err
        assert says in err, err
        assert "Traceback" not in err


def test_the_request_names_the_calibration_by_its_hash(tmp_path: Path) -> None:
    table = tmp_path / "calibration.json"
    write_table(table, {"x": (-1.0, 1.0)}, method="entropy")
    parser = argparse.ArgumentParser()
    add_fleet_arguments(parser)
    args = parser.parse_args(
        [
            "deploy",
            "m.onnx",
            "--slot",
            "cls",
            "--version",
            "1",
            "--unsigned",
            "--precision",
            "int8",
            "--calib-cache",
            str(table),
        ]
    )
    fields = manifest_fields(args)
    assert fields["calib_sha256"] == sha256_file(table)
    request = RolloutRequest(model_sha256="a" * 64, model_name="m.onnx", devices=["d1"], **fields)
    assert request.calib_sha256 == sha256_file(table)
    with pytest.raises(ValueError, match="needs an INT8 build"):
        RolloutRequest(
            model_sha256="a" * 64, model_name="m.onnx", devices=["d1"], **{**fields, "build": None}
        )
