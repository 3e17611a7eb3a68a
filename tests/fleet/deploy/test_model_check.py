"""The operator's model check before signing (agent/fleet/deploy/model_check.py): real ONNX files, good and
bad, and ``fleet deploy`` / ``fleet rollout start`` refusing a bad one with nothing published."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from agent.cli import main
from agent.demo.broker import Broker
from agent.fleet.deploy.model_check import ModelFileError, check_model_file
from agent.specs.postprocess import ClassificationSpec
from agent.specs.preprocess import PreprocessSpec
from tests.fleet.operator_side import announce, tiny_model, unique_prefix
from tests.mqtt_probe import Probe


def _readme(tmp_path: Path) -> Path:
    """A README where a model should be (the operator's slip in issue 20.15)."""
    path = tmp_path / "README.md"
    path.write_text("# Edge agent\n\nRuns ONNX models on Jetson devices.\n")
    return path


def _relu_model(path: Path, *, opset: int = 13, op: str = "Relu", with_input: bool = True) -> Path:
    """A one-node ONNX model (``x -> op -> y``), or a Constant-only one without inputs."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 32, 32])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 32, 32])
    if with_input:
        node = helper.make_node(op, ["x"], ["y"])
    else:
        value = helper.make_tensor("v", TensorProto.FLOAT, [1, 3, 32, 32], [0.0] * (3 * 32 * 32))
        node = helper.make_node("Constant", [], ["y"], value=value)
    graph = helper.make_graph([node], "g", [x] if with_input else [], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _truncated(tmp_path: Path) -> Path:
    path = tmp_path / "truncated.onnx"
    path.write_bytes(tiny_model(tmp_path / "whole.onnx").read_bytes()[:3000])
    return path


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (_readme, "model file is not a readable ONNX model (truncated or corrupt): Error parsing"),
        (_truncated, "not a readable ONNX model"),
        (lambda tmp: _relu_model(tmp / "op.onnx", op="Frobnicate"), "onnx.checker refuses the model: No Op"),
        (lambda tmp: _relu_model(tmp / "old.onnx", opset=5), "ONNX opset 5 is older than 7"),
        (lambda tmp: _relu_model(tmp / "new.onnx", opset=99), "ONNX opset 99 is newer than any released"),
        (lambda tmp: _relu_model(tmp / "const.onnx", with_input=False), "the model has no inputs"),
    ],
    ids=["not onnx", "truncated", "checker", "opset too old", "opset too new", "no inputs"],
)
def test_a_file_no_device_would_load_is_refused_naming_it_and_what_is_wrong(
    tmp_path: Path, make: object, problem: str
) -> None:
    path = make(tmp_path)  # type: ignore[operator]
    with pytest.raises(ModelFileError) as info:
        check_model_file(path)
    assert str(info.value).startswith(f"{path}: ")
    assert problem in str(info.value)
    assert str(info.value).endswith("; nothing signed or published")
    assert info.value.code == "bad_model"


def test_a_good_model_passes_and_the_deploys_pre_and_postprocess_are_checked_against_it(
    tmp_path: Path,
) -> None:
    model = tiny_model(tmp_path / "m.onnx")  # input [1, 3, 32, 32], scores [1, 4]
    check_model_file(model)
    check_model_file(model, preprocess=PreprocessSpec(width=32, height=32))
    with pytest.raises(ModelFileError, match="does not fit the deploy's preprocess/postprocess"):
        check_model_file(model, preprocess=PreprocessSpec(width=64, height=64))
    with pytest.raises(ModelFileError, match="does not fit"):
        check_model_file(model, postprocess=ClassificationSpec(output_name="nope"))


def _sent_to_devices_or_controller(probe: Probe, prefix: str) -> list[str]:
    """Topics of what the operator side published (``down/...``, controller requests) before a
    marker sent now: the broker delivers one publisher's messages in order."""
    marker = f"{prefix}/_test/marker"
    probe.publish(marker, b"end")
    messages = probe.wait_for(lambda ms: any(m.topic == marker for m in ms))
    return [m.topic for m in messages if "/down/" in m.topic or "/_controller/req/" in m.topic]


@pytest.mark.parametrize("command", ["deploy", "rollout start"])
def test_deploy_and_rollout_start_refuse_a_readme_before_signing_or_publishing(
    tmp_path: Path, broker: Broker, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 20.15: ``fleet deploy README.md --device cam-a1`` published a signed, retained desired
    state the device pulled before refusing it ``bad_onnx``."""
    from agent.fleet.deploy.keys import write_keypair

    prefix = unique_prefix()
    keys = write_keypair(tmp_path / "keys", "ops")
    readme = _readme(tmp_path)
    argv = ["fleet", *command.split(), str(readme), "--device", "cam-a1", "--slot", "cls", "--version", "2"]
    if command == "deploy":
        argv += ["--key", str(keys.private), "--key-id", keys.key_id]
    else:
        argv += ["--timeout", "5"]  # no controller runs: a request sent would go unanswered
    argv += ["--broker", f"{broker.host}:{broker.port}", "--prefix", prefix]
    with Probe(broker.host, broker.port) as probe:
        announce(probe, prefix, "cam-a1")  # an online device: a deploy would publish to it
        probe.subscribe(f"{prefix}/#")
        assert main(argv) == 1
        published = _sent_to_devices_or_controller(probe, prefix)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"error: {readme}: model file is not a readable ONNX model")
    assert err[0].endswith("; nothing signed or published")
    assert published == []
