"""Configuration loading: YAML, environment overrides, path resolution, operator-facing errors."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Annotated, Any, get_args, get_origin

import pytest
from pydantic import BaseModel
from structlog.testing import capture_logs

from agent.camera.source_spec import FileSourceSpec, SyntheticSourceSpec
from agent.config import AgentConfig, check_config, load_config, read_secret
from agent.errors import ConfigError
from agent.specs.postprocess import DetectionSpec

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "configs" / "agent.example.yaml"

MINIMAL = """
device_id: jetson-0001
slots:
  cls:
    model: models/m.onnx
streams:
  cam0:
    slot: cls
    source: {type: synthetic, width: 64, height: 48}
"""


def _write(directory: Path, text: str, name: str = "agent.yaml") -> Path:
    path = directory / name
    path.write_text(text, encoding="utf-8")
    return path


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


@pytest.fixture
def conf_dir(tmp_path: Path) -> Path:
    """A config directory holding models/m.onnx (load_config only checks that it exists)."""
    directory = tmp_path / "etc"
    _touch(directory / "models" / "m.onnx")
    return directory


def _problems(path: Path, environ: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, environ or {})
    return info.value.problems


# --- loading ------------------------------------------------------------------------------


def test_minimal_config_loads_with_defaults(conf_dir: Path) -> None:
    config = load_config(_write(conf_dir, MINIMAL), {})
    assert config.device_id == "jetson-0001"
    assert config.mqtt.port == 1883
    assert config.logging.format == "json"
    assert config.slots["cls"].max_batch == 4
    assert isinstance(config.streams["cam0"].source, SyntheticSourceSpec)
    assert config.streams["cam0"].source.width == 64
    assert check_config(conf_dir / "agent.yaml", {}) == []


def test_relative_paths_resolve_against_the_config_directory(
    conf_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _touch(conf_dir / "labels" / "coco.txt")
    _touch(conf_dir / "secrets" / "pw")
    for name in ("ca.pem", "dev.crt", "dev.key"):
        _touch(conf_dir / "tls" / name)
    text = """
device_id: d1
state_dir: state
mqtt:
  username: d1
  password_file: secrets/pw
  tls: {ca_file: tls/ca.pem, cert_file: tls/dev.crt, key_file: tls/dev.key}
slots:
  det:
    model: models/m.onnx
    postprocess: {type: detection, labels_file: labels/coco.txt}
streams:
  door:
    slot: det
    source: {type: file, path: videos/door.mp4}
telemetry:
  sysfs_root: fake-sys
"""
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # paths must not depend on the working directory
    config = load_config(_write(conf_dir, text), {})

    assert config.state_dir == conf_dir / "state"
    assert config.slots["det"].model == conf_dir / "models" / "m.onnx"
    post = config.slots["det"].postprocess
    assert isinstance(post, DetectionSpec)
    assert post.labels_file == conf_dir / "labels" / "coco.txt"
    assert config.mqtt.password_file == conf_dir / "secrets" / "pw"
    assert config.mqtt.tls is not None
    assert config.mqtt.tls.ca_file == conf_dir / "tls" / "ca.pem"
    assert config.mqtt.tls.cert_file == conf_dir / "tls" / "dev.crt"
    assert config.mqtt.tls.key_file == conf_dir / "tls" / "dev.key"
    source = config.streams["door"].source
    assert isinstance(source, FileSourceSpec)
    # A file source's video need not exist yet (the camera may appear later), but its path resolves.
    assert source.path == conf_dir / "videos" / "door.mp4"
    assert config.telemetry.sysfs_root == conf_dir / "fake-sys"


def test_relative_config_path_gives_absolute_paths(conf_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(conf_dir, MINIMAL)
    monkeypatch.chdir(conf_dir.parent)
    config = load_config(Path("etc/agent.yaml"), {})
    assert config.slots["cls"].model.is_absolute()
    assert config.slots["cls"].model == conf_dir / "models" / "m.onnx"


def test_absolute_paths_are_kept(conf_dir: Path, tmp_path: Path) -> None:
    model = _touch(tmp_path / "elsewhere" / "x.onnx")
    config = load_config(_write(conf_dir, MINIMAL.replace("models/m.onnx", str(model))), {})
    assert config.slots["cls"].model == model


def test_empty_sections_take_their_defaults(conf_dir: Path) -> None:
    text = MINIMAL + "telemetry:\nlogging:\nmqtt:\n  tls:\n"
    text = text.replace("    model: models/m.onnx", "    model: models/m.onnx\n    preprocess:")
    config = load_config(_write(conf_dir, text), {})
    assert config.telemetry.interval_s == 10.0
    assert config.logging.level == "info"
    assert config.mqtt.tls is None
    assert config.slots["cls"].preprocess.width == 224


# --- environment overrides ----------------------------------------------------------------


def test_environment_overrides_parse_yaml_scalars(conf_dir: Path, tmp_path: Path) -> None:
    other = _touch(tmp_path / "x.onnx")
    environ = {
        "EDGE_AGENT__MQTT__PORT": "1884",
        "EDGE_AGENT__MQTT__HOST": "broker.lan",
        "EDGE_AGENT__SLOTS__CLS__MODEL": str(other),
        "EDGE_AGENT__SLOTS__CLS__PROVIDERS": "[CUDAExecutionProvider, CPUExecutionProvider]",
        "EDGE_AGENT__STREAMS__CAM0__DURABLE_RESULTS": "true",
        "EDGE_AGENT__STREAMS__CAM0__FPS_LIMIT": "2.5",
        "EDGE_AGENT__LOGGING__LEVEL": "debug",
        "EDGE_AGENT": "no separator: ignored",
        "PATH": os.environ.get("PATH", ""),
    }
    config = load_config(_write(conf_dir, MINIMAL), environ)
    assert config.mqtt.port == 1884
    assert config.mqtt.host == "broker.lan"
    assert config.slots["cls"].model == other
    assert config.slots["cls"].providers == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert config.streams["cam0"].durable_results is True
    assert config.streams["cam0"].fps_limit == 2.5
    assert config.logging.level == "debug"


def test_environment_defaults_to_os_environ(conf_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGE_AGENT__TELEMETRY__INTERVAL_S", "3")
    assert load_config(_write(conf_dir, MINIMAL)).telemetry.interval_s == 3.0


def test_environment_creates_missing_sections_and_matches_keys_case_insensitively(conf_dir: Path) -> None:
    text = MINIMAL.replace("cam0:", "Cam0:")
    environ = {
        "EDGE_AGENT__STREAMS__CAM0__QUEUE_SIZE": "8",  # the stream is spelled Cam0 in the file
        "EDGE_AGENT__MQTT__TLS__INSECURE": "yes",
    }
    config = load_config(_write(conf_dir, text), environ)
    assert set(config.streams) == {"Cam0"}
    assert config.streams["Cam0"].queue_size == 8
    assert config.mqtt.tls is not None
    assert config.mqtt.tls.insecure is True


def test_relative_path_from_environment_resolves_against_config_directory(conf_dir: Path) -> None:
    _touch(conf_dir / "models" / "v2.onnx")
    config = load_config(_write(conf_dir, MINIMAL), {"EDGE_AGENT__SLOTS__CLS__MODEL": "models/v2.onnx"})
    assert config.slots["cls"].model == conf_dir / "models" / "v2.onnx"


def test_bad_environment_value_names_the_variable(conf_dir: Path) -> None:
    problems = _problems(
        _write(conf_dir, MINIMAL), {"EDGE_AGENT__MQTT__PORT": "abc", "EDGE_AGENT__MQTT__PROT": "1"}
    )
    assert problems == [
        "mqtt.port: must be an integer, not 'abc' (set by environment variable EDGE_AGENT__MQTT__PORT)",
        "mqtt.prot: unknown key (did you mean 'port'?) (set by environment variable EDGE_AGENT__MQTT__PROT)",
    ]


def test_environment_below_a_scalar_is_refused(conf_dir: Path) -> None:
    problems = _problems(
        _write(conf_dir, MINIMAL), {"EDGE_AGENT__DEVICE_ID__X": "1", "EDGE_AGENT__MQTT____A": "1"}
    )
    assert problems == [
        "EDGE_AGENT__DEVICE_ID__X: cannot set a key below device_id, which is not a mapping",
        "EDGE_AGENT__MQTT____A: empty key level; write EDGE_AGENT__SECTION__KEY=value",
    ]


# --- errors -------------------------------------------------------------------------------


BROKEN = """
device_id: bad id!
mqtt: {prot: 1, port: 0}
slots:
  cls:
    model: models/m.onnx
    version: 1.10
    preprocess: {width: 0, mean: [1, 2], color: rgbx}
    postprocess: {type: det}
  c2: {model: models/missing.onnx, postprocess: {type: raw, max_values: lots}}
streams:
  cam0: {source: {type: webcam}, slot: cls}
  cam1: {source: {type: file}, slot: cls, results_qos: 2}
  cam2: {source: {}, slot: nope}
  cam3: {source: rtsp://x, slot: other}
logging: loud
"""


def test_every_problem_is_collected_with_its_key_path(conf_dir: Path) -> None:
    path = _write(conf_dir, BROKEN)
    with pytest.raises(ConfigError) as info:
        load_config(path, {})
    problems = info.value.problems
    missing = conf_dir / "models" / "missing.onnx"
    assert problems == [
        "device_id: 'bad id!' is not a valid name: use 1-64 letters, digits, '_', '.' or '-', "
        "starting with a letter or digit",
        "logging: must be a mapping of keys, not 'loud'",
        "mqtt.port: must be greater than 0",
        "mqtt.prot: unknown key (did you mean 'port'?)",
        f"slots.c2.model: file not found: {missing}",
        "slots.c2.postprocess.max_values: must be an integer, not 'lots'",
        "slots.cls.postprocess.type: 'det' is not one of classification, detection, raw",
        "slots.cls.preprocess.color: 'rgbx' is not one of rgb, bgr",
        "slots.cls.preprocess.mean: must be a list of 3 values",
        "slots.cls.preprocess.width: must be greater than 0",
        "slots.cls.version: must be a string, not 1.1 (put it in quotes)",
        "streams.cam0.source.type: 'webcam' is not one of file, v4l2, url, gstreamer, synthetic",
        "streams.cam1.results_qos: 2 is not one of 0, 1",
        "streams.cam1.source.path: required key is missing",
        "streams.cam2.slot: no slot named 'nope' (slots: c2, cls)",
        "streams.cam2.source.type: required key is missing (one of file, v4l2, url, gstreamer, synthetic)",
        "streams.cam3.slot: no slot named 'other' (slots: c2, cls)",
        "streams.cam3.source: must be a mapping of keys, not 'rtsp://x'",
    ]
    message = str(info.value)
    assert message.startswith(f"invalid configuration {path} (18 problems):")
    assert all(problem in message for problem in problems)
    assert check_config(path, {}) == problems


def test_unknown_slot_is_reported_once_when_everything_else_is_valid(conf_dir: Path) -> None:
    text = MINIMAL.replace("slot: cls", "slot: clss")
    assert _problems(_write(conf_dir, text)) == ["streams.cam0.slot: no slot named 'clss' (slots: cls)"]


def test_unknown_keys_are_rejected_with_a_hint(conf_dir: Path) -> None:
    text = MINIMAL + "telemetry: {intervals: 5}\nextra_section: 1\n"
    problems = _problems(_write(conf_dir, text))
    assert problems[0] == "extra_section: unknown key (allowed: " + ", ".join(AgentConfig.model_fields) + ")"
    assert problems[1] == "telemetry.intervals: unknown key (did you mean 'interval_s'?)"


def test_unknown_key_inside_a_source_names_the_key_not_the_type(conf_dir: Path) -> None:
    text = MINIMAL.replace("width: 64", "widht: 64")
    assert _problems(_write(conf_dir, text)) == [
        "streams.cam0.source.widht: unknown key (did you mean 'width'?)"
    ]


def test_invalid_slot_name(conf_dir: Path) -> None:
    text = MINIMAL.replace("  cls:", "  -cls:").replace("slot: cls", "slot: -cls")
    problems = _problems(_write(conf_dir, text))
    assert any(p.startswith("slots.-cls: '-cls' is not a valid name") for p in problems), problems


def test_missing_device_id_and_empty_value(conf_dir: Path) -> None:
    assert _problems(_write(conf_dir, MINIMAL.replace("device_id: jetson-0001", ""))) == [
        "device_id: required key is missing"
    ]
    assert _problems(_write(conf_dir, MINIMAL.replace("jetson-0001", ""))) == [
        "device_id: must have a value (it is empty)"
    ]


def test_files_that_must_exist(conf_dir: Path) -> None:
    (conf_dir / "models" / "m.onnx").unlink()
    (conf_dir / "tls").mkdir()
    text = MINIMAL + (
        "mqtt:\n  password_file: pw.txt\n"
        "  tls: {ca_file: tls, cert_file: tls/c.pem, key_file: /nonexistent/k.pem}\n"
    )
    text = text.replace(
        "model: models/m.onnx",
        "model: models/m.onnx\n    postprocess: {type: classification, labels_file: l.txt}",
    )
    assert _problems(_write(conf_dir, text)) == [
        f"mqtt.password_file: file not found: {conf_dir / 'pw.txt'}",
        f"mqtt.tls.ca_file: not a regular file: {conf_dir / 'tls'}",
        f"mqtt.tls.cert_file: file not found: {conf_dir / 'tls' / 'c.pem'}",
        "mqtt.tls.key_file: file not found: /nonexistent/k.pem",
        f"slots.cls.model: file not found: {conf_dir / 'models' / 'm.onnx'}",
        f"slots.cls.postprocess.labels_file: file not found: {conf_dir / 'l.txt'}",
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("device_id: a\nslots: [1, 2\n", "YAML syntax error at line 3, column 1"),
        ("device_id: a\nmqtt:\n  port: 1\n   host: x\n", "YAML syntax error at line 4, column 8"),
        ("device_id: a\ndevice_id: b\n", "YAML syntax error at line 2, column 1"),
        ("", "the file is empty"),
        ("- device_id: a\n", "the top level must be a mapping of keys, not a list"),
    ],
)
def test_unreadable_yaml(conf_dir: Path, text: str, expected: str) -> None:
    path = _write(conf_dir, text)
    problems = _problems(path)
    assert len(problems) == 1
    assert problems[0].startswith(f"{path}: {expected}"), problems[0]


def test_duplicate_key_names_the_key(conf_dir: Path) -> None:
    problems = _problems(_write(conf_dir, MINIMAL + "device_id: again\n"))
    assert "duplicate key 'device_id' (first at line 2)" in problems[0]


def test_yaml_merge_keys_may_override_merged_values(conf_dir: Path) -> None:
    base = """
device_id: d1
slots: {cls: {model: models/m.onnx}}
streams:
  a: &cam {slot: cls, queue_size: 2, source: {type: synthetic}}
  b:
    <<: *cam
    queue_size: 7
"""
    config = load_config(_write(conf_dir, base), {})
    assert config.streams["a"].queue_size == 2
    assert config.streams["b"].queue_size == 7
    assert config.streams["b"].slot == "cls"


def test_missing_file_and_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    assert _problems(missing) == [
        f"{missing}: file not found; pass the path of the agent's YAML configuration"
    ]
    assert _problems(tmp_path)[0].startswith(f"{tmp_path}: cannot read")


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_bytes(b"device_id: \xff\xfe\n")
    assert _problems(path)[0].startswith(f"{path}: not UTF-8 text")


# --- secrets ------------------------------------------------------------------------------


def test_read_secret_strips_one_trailing_newline(tmp_path: Path) -> None:
    path = tmp_path / "pw"
    path.write_text("s3cret\n\n")
    path.chmod(0o600)
    assert read_secret(path) == "s3cret\n"
    path.write_bytes(b"s3cret\r\n")
    assert read_secret(path) == "s3cret"
    path.write_text(" spaced ")
    assert read_secret(path) == " spaced "


def test_read_secret_warns_when_others_can_read(tmp_path: Path) -> None:
    path = tmp_path / "pw"
    path.write_text("s3cret\n")
    path.chmod(0o600)
    with capture_logs() as logs:
        read_secret(path)
    assert logs == []
    path.chmod(0o640)
    with capture_logs() as logs:
        assert read_secret(path) == "s3cret"
    assert [e["event"] for e in logs] == ["config.secret.readable"]
    assert logs[0]["log_level"] == "warning"
    assert logs[0]["mode"] == "0o640"
    assert "s3cret" not in repr(logs)


def test_read_secret_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read secret file .*nope: No such file"):
        read_secret(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    empty.chmod(0o600)
    with pytest.raises(ConfigError, match="is empty"):
        read_secret(empty)


# --- the example configuration --------------------------------------------------------------


def _models(tp: Any, seen: dict[str, type[BaseModel]]) -> dict[str, type[BaseModel]]:
    """Every pydantic model reachable from annotation ``tp`` (unions, dicts, lists, Optional)."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        if tp.__name__ not in seen:
            seen[tp.__name__] = tp
            for field in tp.model_fields.values():
                _models(field.annotation, seen)
        return seen
    origin = get_origin(tp)
    if origin is Annotated:
        return _models(get_args(tp)[0], seen)
    if origin is not None:
        for arg in get_args(tp):
            _models(arg, seen)
    return seen


def test_example_documents_every_key() -> None:
    text = EXAMPLE.read_text()
    models = _models(AgentConfig, {})
    # Sanity: the walk reaches the nested and union models, so the check below means something.
    assert {"MqttSettings", "TlsSettings", "PreprocessSpec", "RawSpec", "GStreamerSourceSpec"} <= set(models)
    undocumented = [
        f"{model.__name__}.{name}"
        for model in models.values()
        for name in model.model_fields
        if not re.search(rf"^[ \t]*(#[ \t]*)?{re.escape(name)}:", text, re.MULTILINE)
    ]
    assert undocumented == []
    for model in models.values():  # every source and postprocess kind is shown
        type_field = model.model_fields.get("type")
        if type_field is not None:
            assert re.search(rf"type: {type_field.default}\b", text), model.__name__


def test_example_loads(tmp_path: Path) -> None:
    config_path = tmp_path / "agent.yaml"
    shutil.copy(EXAMPLE, config_path)
    needed = [
        "models/classifier.onnx",
        "models/detector.onnx",
        "labels/classes.txt",
        "tls/ca.pem",
        "tls/device.crt",
        "tls/device.key",
    ]
    for name in needed:
        _touch(tmp_path / name)
    config = load_config(config_path, {})
    assert config.device_id == "jetson-0001"
    assert config.mqtt.tls is not None
    assert config.mqtt.tls.ca_file == tmp_path / "tls" / "ca.pem"
    assert set(config.slots) == {"cls", "det"}
    assert set(config.streams) == {"usb0", "csi0"}
    # Without those files the example names each one.
    (tmp_path / "tls" / "device.key").unlink()
    assert check_config(config_path, {}) == [
        f"mqtt.tls.key_file: file not found: {tmp_path / 'tls' / 'device.key'}"
    ]


def test_missing_file_in_an_invalid_section_still_shows_the_absolute_path(conf_dir: Path) -> None:
    text = MINIMAL.replace(
        "model: models/m.onnx", "model: models/m.onnx\n    postprocess: {labels_file: l.txt}"
    )
    assert _problems(_write(conf_dir, text)) == [
        f"slots.cls.postprocess.labels_file: file not found: {conf_dir / 'l.txt'}",
        "slots.cls.postprocess.type: required key is missing (one of classification, detection, raw)",
    ]


def test_labels_load_and_follow_the_kubernetes_rules(conf_dir: Path) -> None:
    good = MINIMAL + "labels: {site: berlin-3, camera: dock, example.com/hw: orin-nx, note: ''}\n"
    assert load_config(_write(conf_dir, good), {}).labels == {
        "site": "berlin-3",
        "camera": "dock",
        "example.com/hw": "orin-nx",
        "note": "",
    }
    bad = MINIMAL + "labels: {site: berlin 3, -cam: dock, platform.dla_cores: '9', Ex.com/hw: x}\n"
    # One line per bad label, naming the key path, the rule it breaks and the offending text.
    assert _problems(_write(conf_dir, bad)) == [
        "labels.-cam: label key '-cam': use 1-63 letters, digits, '-', '_' or '.', starting and ending "
        "with a letter or digit (optionally after a DNS prefix and '/')",
        "labels.Ex.com/hw: label key 'Ex.com/hw': the prefix before '/' must be a DNS subdomain "
        "(lower case, at most 253)",
        "labels.platform.dla_cores: label key 'platform.dla_cores': keys starting with 'platform.' or "
        "'agent.' name device facts in selectors",
        "labels.site: label value 'berlin 3': use at most 63 letters, digits, '-', '_' or '.', starting "
        "and ending with a letter or digit",
    ]


def test_an_enrollment_section_lets_the_device_certificate_and_key_be_missing_but_not_the_claim(
    conf_dir: Path,
) -> None:
    """The first start writes mqtt.tls.cert_file and key_file itself; the claim and the trust anchors
    must be in place (docs/enrollment.md)."""
    _touch(conf_dir / "tls" / "ca.pem")
    text = MINIMAL + (
        "mqtt:\n  port: 8883\n"
        "  tls: {ca_file: tls/ca.pem, cert_file: tls/device.crt, key_file: tls/device.key}\n"
        "enrollment:\n  claim_cert_file: tls/claim.crt\n  claim_key_file: tls/claim.key\n"
    )
    assert _problems(_write(conf_dir, text)) == [
        f"enrollment.claim_cert_file: file not found: {conf_dir / 'tls' / 'claim.crt'}",
        f"enrollment.claim_key_file: file not found: {conf_dir / 'tls' / 'claim.key'}",
    ]
    _touch(conf_dir / "tls" / "claim.crt")
    _touch(conf_dir / "tls" / "claim.key")
    config = load_config(_write(conf_dir, text), {})
    assert config.enrollment is not None
    assert config.enrollment.claim_key_file == conf_dir / "tls" / "claim.key"
    assert config.enrollment.port == 8885
    assert config.enrollment.renewal.at_fraction == pytest.approx(2 / 3)


def test_an_enrollment_section_needs_somewhere_to_write_the_device_certificate(conf_dir: Path) -> None:
    _touch(conf_dir / "claim.crt")
    _touch(conf_dir / "claim.key")
    text = MINIMAL + "enrollment:\n  claim_cert_file: claim.crt\n  claim_key_file: claim.key\n"
    (problem,) = _problems(_write(conf_dir, text))
    assert "mqtt.tls.ca_file" in problem
    assert "mqtt.tls.cert_file" in problem
    bad = text + "  renewal: {at_fraction: 1.5}\n"
    assert any("enrollment.renewal.at_fraction" in p for p in _problems(_write(conf_dir, bad)))
