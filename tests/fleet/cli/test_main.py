"""``edge-agent fleet ...`` through the real argument parser: keygen, deploy's flags and exit codes."""

from __future__ import annotations

import argparse
import json
import stat
import threading
from pathlib import Path
from typing import Any

import pytest

from agent.cli import main
from agent.demo.broker import Broker, free_port
from agent.errors import ConfigError
from agent.fleet.cli.deploy import build_spec_from_args, postprocess_from_args
from agent.fleet.cli.main import add_fleet_arguments
from agent.protocol.messages import JobState, JobStatus, encode
from agent.protocol.proving import ShadowSpec
from agent.protocol.topics import Topics
from agent.specs.postprocess import ClassificationSpec, DetectionSpec
from tests.fleet.operator_side import announce, tiny_model, unique_prefix, unsigned_deploy
from tests.mqtt_probe import Probe
from tests.waiting import patient


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_fleet_arguments(parser)
    return parser.parse_args(list(argv))


def test_keygen_writes_the_pair_and_refuses_to_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["fleet", "keygen", "--out", str(tmp_path), "--key-id", "ops"]) == 0
    assert stat.S_IMODE((tmp_path / "ops.key").stat().st_mode) == 0o600
    assert "trusted_keys" in capsys.readouterr().out
    assert main(["fleet", "keygen", "--out", str(tmp_path), "--key-id", "ops"]) == 1
    assert "already exists" in capsys.readouterr().err


def test_labels_and_postprocess_json(tmp_path: Path) -> None:
    labels = tmp_path / "labels.txt"
    labels.write_text("cat\ndog\n\n")
    assert postprocess_from_args(None, labels) == ClassificationSpec(labels=["cat", "dog"], top_k=2)
    detection = postprocess_from_args('{"type": "detection", "format": "yolov5"}', labels)
    assert isinstance(detection, DetectionSpec)
    assert (detection.format, detection.labels) == ("yolov5", ["cat", "dog"])
    assert postprocess_from_args(None, None) is None
    with pytest.raises(ConfigError) as info:
        postprocess_from_args('{"type": "classification", "top_k": 0}', None)
    assert "top_k" in info.value.problems[0]


def test_build_flags_make_a_build_spec_only_when_given() -> None:
    base = ("deploy", "m.onnx", "--device", "d", "--slot", "s", "--version", "1", "--unsigned")
    assert build_spec_from_args(_parse(*base)) is None
    spec = build_spec_from_args(
        _parse(*base, "--precision", "int8", "--engine-device", "dla0", "--no-gpu-fallback")
    )
    assert spec is not None
    assert (spec.precision, spec.device, spec.gpu_fallback) == ("int8", "dla0", False)


def test_signing_is_explicit() -> None:
    with pytest.raises(SystemExit):
        _parse("deploy", "m.onnx", "--device", "d", "--slot", "s", "--version", "1")
    assert (
        main(["fleet", "deploy", "m.onnx", "--device", "d", "--slot", "s", "--version", "1", "--key", "k"])
        == 1
    )


def test_deploy_exits_non_zero_and_prints_each_failure(
    tmp_path: Path, broker: Broker, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = unique_prefix()
    model = tiny_model(tmp_path / "net.onnx")
    with Probe(broker.host, broker.port) as device:
        announce(device, prefix, "jet-1", "jet-2")
        device.subscribe(f"{prefix}/+/down/desired/cls")

        def refuse_all() -> None:
            # Plays two devices: each refuses the manifest it finds on its desired topic.
            for message in device.wait_for(lambda ms: len(ms) >= 2, timeout=20):
                dev = message.topic.split("/")[2]
                job_id = json.loads(json.loads(message.payload)["manifest"])["job_id"]
                status = JobStatus(
                    job_id=job_id,
                    slot="cls",
                    state=JobState.REJECTED,
                    error_code="unsigned",
                    error=f"{dev} says no",
                )
                device.publish(Topics(prefix, dev).jobs(job_id), encode(status))

        thread = threading.Thread(target=refuse_all, daemon=True)
        thread.start()
        code = main(
            [
                "fleet", "deploy", str(model), "--device", "jet-1,jet-2", "--slot", "cls", "--version", "3",
                "--unsigned", "--chunk-size", "4096", "--timeout", "20",
                "--broker", f"{broker.host}:{broker.port}", "--prefix", prefix,
            ]
        )  # fmt: skip
        thread.join(patient(5))
    captured = capsys.readouterr()
    assert code == 1, captured.out + captured.err
    assert "UNSIGNED" in captured.out
    assert "2 of 2 device(s) did not reach ACTIVE" in captured.err
    assert "jet-1: REJECTED unsigned: jet-1 says no" in captured.err
    assert "jet-2: REJECTED unsigned: jet-2 says no" in captured.err


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_command_line_mistakes_name_the_flag_and_are_not_config_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny_model(tmp_path / "m.onnx")
    deploy = ["fleet", "deploy", str(model), "--device", "d1", "--slot", "cls", "--version", "1"]
    cases = [
        (["fleet", "cmd", "d1", "status", "--args", "{"], "error: --args: not valid JSON"),
        ([*deploy, "--key", str(tmp_path / "k.key")], "error: --key needs --key-id"),
        (
            ["fleet", "deploy", str(tmp_path / "nope.onnx"), *deploy[3:], "--unsigned"],
            f"error: MODEL.onnx: {tmp_path / 'nope.onnx'} is not a file",
        ),
        (
            ["fleet", "status", "--broker", "localhost:99999"],
            "error: --broker: Input should be less than 65536",
        ),
        (["fleet", "status", "--broker", "localhost:http"], "error: --broker 'localhost:http': port 'http'"),
    ]
    for argv, start in cases:
        assert main(argv) == 1, argv
        line = _one_error_line(capsys)
        assert line.startswith(start), (argv, line)


def test_keygen_on_an_existing_key_points_at_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["fleet", "keygen", "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    assert main(["fleet", "keygen", "--out", str(tmp_path)]) == 1
    line = _one_error_line(capsys)
    assert line.startswith(f"error: {tmp_path / 'fleet.key'} already exists; pass --force"), line
    assert main(["fleet", "keygen", "--out", str(tmp_path), "--force"]) == 0


def test_a_refused_broker_names_what_the_user_set(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    assert main(["fleet", "status", "--broker", f"127.0.0.1:{port}", "--retained-wait", "20"]) == 1
    line = _one_error_line(capsys)
    assert line == (
        f"error: cannot connect to the MQTT broker at 127.0.0.1:{port}: Connection refused; "
        "check --broker (is the broker running there?)"
    )
    config = tmp_path / "operator.yaml"
    config.write_text(f"mqtt:\n  host: 127.0.0.1\n  port: {port}\n")
    assert main(["fleet", "status", "-c", str(config), "--retained-wait", "20"]) == 1
    assert f"check mqtt.host/port in {config}" in _one_error_line(capsys)


def test_deploy_to_an_unknown_device_ends_at_once_naming_it(
    tmp_path: Path, broker: Broker, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = unique_prefix()
    model = tiny_model(tmp_path / "net.onnx")
    code = main(
        [
            "fleet", "deploy", str(model), "--device", "jet-typo", "--slot", "cls", "--version", "3",
            "--unsigned", "--timeout", "600", "--broker", f"{broker.host}:{broker.port}", "--prefix", prefix,
        ]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code == 4, captured.out + captured.err
    assert "published to" not in captured.out  # issue 22.9: no "published to 0 ... serving the chunks"
    assert "serving the chunks" not in captured.out
    assert "deploy: nothing published: no target is a known device" in captured.err
    assert f"unknown device(s) jet-typo: no retained {prefix}/{{device}}/up/status" in captured.err
    assert "--wait-unknown waits for them" in captured.err
    assert "jet-typo: unknown device" in captured.err


def test_shadow_and_probation_flag_mistakes_name_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny_model(tmp_path / "m.onnx")
    deploy = unsigned_deploy(model)
    cases = [
        ([*deploy, "--shadow-json", '{"frames": 0}'], "error: --shadow-json frames: Input should be greater"),
        ([*deploy, "--shadow-json", '{"min_agreement": 2}'], "error: --shadow-json min_agreement:"),
        ([*deploy, "--probation-json", '{"max_fps": 1}'], "error: --probation-json max_fps:"),
        ([*deploy, "--probation-s", "-1"], "error: --probation-s must be between 0 and 86400"),
    ]
    for argv, start in cases:
        assert main(argv) == 1, argv
        line = _one_error_line(capsys)
        assert line.startswith(start), (argv, line)


def _manifest_sent(tmp_path: Path, broker: Broker, *flags: str) -> dict[str, Any]:
    """The manifest ``fleet deploy ... FLAGS`` publishes, read by a probe playing the device (which
    then refuses it, so the deploy ends at once)."""
    prefix = unique_prefix()
    model = tiny_model(tmp_path / "net.onnx")
    sent: list[dict[str, object]] = []
    with Probe(broker.host, broker.port) as device:
        announce(device, prefix, "jet-1")
        device.subscribe(f"{prefix}/jet-1/down/desired/cls")

        def refuse() -> None:
            message = device.wait_for(bool, timeout=20)[0]
            manifest = json.loads(json.loads(message.payload)["manifest"])
            sent.append(manifest)
            status = JobStatus(job_id=manifest["job_id"], slot="cls", state=JobState.REJECTED, error_code="x")
            device.publish(Topics(prefix, "jet-1").jobs(manifest["job_id"]), encode(status))

        thread = threading.Thread(target=refuse, daemon=True)
        thread.start()
        main(
            [
                "fleet", "deploy", str(model), "--device", "jet-1", "--slot", "cls", "--version", "3",
                "--unsigned", "--timeout", "20", "--broker", f"{broker.host}:{broker.port}",
                "--prefix", prefix, *flags,
            ]
        )  # fmt: skip
        thread.join(patient(5))
    assert len(sent) == 1
    return sent[0]


def test_deploy_asks_for_60_s_of_probation_unless_told_and_0_leaves_the_field_out(
    tmp_path: Path, broker: Broker
) -> None:
    """The manifest model keeps "absent: no probation" (older manifests and agents); the operator
    tool is where the issue's 60 s default lives."""
    assert _manifest_sent(tmp_path, broker)["probation_s"] == 60.0
    assert _manifest_sent(tmp_path, broker, "--probation-s", "5")["probation_s"] == 5.0
    # 0 skips it by leaving the key out: an agent that predates probation refuses unknown keys.
    assert "probation_s" not in _manifest_sent(tmp_path, broker, "--probation-s", "0")


def test_deploy_asks_for_a_shadow_run_unless_told_and_no_shadow_leaves_the_field_out(
    tmp_path: Path, broker: Broker, capsys: pytest.CaptureFixture[str]
) -> None:
    """Shadow is on by default for fleet deploys (the one-wave rollout); the manifest model keeps
    "absent: no shadow" for older manifests and agents."""
    assert _manifest_sent(tmp_path, broker)["shadow"] == ShadowSpec().model_dump(mode="json")
    custom: dict[str, Any] = _manifest_sent(
        tmp_path, broker, "--shadow-json", '{"frames": 5, "min_agreement": null}'
    )["shadow"]
    # null is the operator's word (a model whose classes changed): it must reach the device as null.
    assert (custom["frames"], custom["min_agreement"]) == (5, None)
    assert "shadow" not in _manifest_sent(tmp_path, broker, "--no-shadow")
    capsys.readouterr()
    model = tiny_model(tmp_path / "m.onnx")
    argv = ["fleet", "deploy", str(model), "--device", "d1", "--slot", "cls", "--version", "1", "--unsigned"]
    assert main([*argv, "--no-shadow", "--shadow-json", "{}"]) == 1
    assert _one_error_line(capsys) == "error: --no-shadow and --shadow-json: give one of them"


def test_status_under_a_prefix_with_no_device_fails_naming_where_it_looked(
    broker: Broker, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 22.9: ``fleet status --prefix fleet/v2`` said "no devices found" and exited 0."""
    prefix = unique_prefix()
    argv = ["fleet", "status", "--broker", f"{broker.host}:{broker.port}", "--prefix", prefix]

    code = main([*argv, "--retained-wait", "1", "--telemetry-wait", "0"])

    captured = capsys.readouterr()
    assert code == 1
    assert captured.out == ""
    assert f"no devices found: nothing retained under {prefix}/+/up/status or up/info on " in captured.err
    assert "check --prefix (the devices' mqtt.prefix, default fleet/v1) and --broker" in captured.err


def test_a_rollout_command_with_no_controller_fails_at_once_saying_so(
    broker: Broker, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 22.9: with no controller, ``fleet rollout status`` waited its whole --timeout. The broker
    answers a request nobody subscribes to "no matching subscribers" at once: that is the error now.
    (A --timeout of 600 would hold this test for ten minutes without the fix.)"""
    prefix = unique_prefix()
    argv = ["--broker", f"{broker.host}:{broker.port}", "--prefix", prefix, "--timeout", "600"]

    code = main(["fleet", "rollout", "status", *argv])

    err = capsys.readouterr().err
    assert code == 1
    assert f"no controller listens on {prefix}/_controller/req/status" in err
    assert f"with prefix {prefix}?" in err


def test_a_redeploy_keeps_the_model_id_the_slot_serves_not_the_files_stem(
    tmp_path: Path, broker: Broker, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 22.10: ``shapes_classifier.onnx`` redeployed to a slot serving ``shapes-classifier``
    renamed the model after the file's stem. The device's retained up/info (as a simulated device
    publishes it) says what the slot serves; the manifest the deploy publishes keeps that id."""
    from agent.protocol.manifest import DeployManifest, SignedManifest
    from tests.fleet.console_rig import info, status

    prefix = unique_prefix()
    model = tiny_model(tmp_path / "shapes_classifier.onnx")
    desired = Topics(prefix, "jet-01").desired("main")
    with Probe(broker.host, broker.port) as probe:
        for topic, payload in (status(prefix, "jet-01"), info(prefix, "jet-01", model="shapes-classifier")):
            probe.publish(topic, payload, retain=True)
        probe.subscribe(desired)
        main(
            [
                "fleet",
                "deploy",
                str(model),
                "--device",
                "jet-01",
                "--slot",
                "main",
                "--version",
                "2",
                "--unsigned",
                "--no-serve",
                "--timeout",
                "1",
                "--retained-wait",
                "2",
                "--broker",
                f"{broker.host}:{broker.port}",
                "--prefix",
                prefix,
            ]
        )  # fmt: skip  (--timeout 1: no device answers; what is published is the point)
        [published] = probe.wait_for_count(desired, 1, timeout=30)
        for topic in (desired, Topics(prefix, "jet-01").status, Topics(prefix, "jet-01").info):
            probe.publish(topic, b"", retain=True)

    manifest = DeployManifest.model_validate_json(
        SignedManifest.model_validate_json(published.payload).manifest
    )
    assert manifest.model_id == "shapes-classifier"
    assert (
        "deploy: model id shapes-classifier (what slot main serves now; --model-id sets another)"
        in capsys.readouterr().out
    )


def test_the_default_model_id_is_the_slots_when_the_targets_agree_and_an_error_when_not() -> None:
    from agent.fleet.deploy.slot_model import default_model_id

    assert default_model_id({}, "net", "main")[0] == "net"
    assert default_model_id({"a": "cls", "b": "cls"}, "net", "main")[0] == "cls"
    with pytest.raises(
        ConfigError, match=r"slot main serves models of different ids on the targets \(a \(1\), b \(1\)\)"
    ):
        default_model_id({"x": "a", "y": "b"}, "net", "main")
