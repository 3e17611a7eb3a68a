"""The ``_config`` target's verify and install on real files: the merge rule, refused keys, sealed values."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from agent.config import load_config
from agent.config.overlay import merge_overlay
from agent.delivery.jobs.steps import GuardReporter, JobReporter
from agent.demo.modelzoo import write_classifier
from agent.lifecycle.config.document import opener
from agent.lifecycle.config.record import (
    ConfigRecord,
    OverlayFiles,
    OverlayRef,
    PendingChange,
    Reading,
    Reverted,
)
from agent.lifecycle.config.startup import MAX_PENDING_STARTS, starting_config
from agent.lifecycle.config.target import ConfigTarget
from agent.lifecycle.health import HealthReading
from agent.lifecycle.running import RunningAgent
from agent.protocol.delivery_errors import ConfigInvalidError, RolledBackError
from agent.protocol.manifest import DeployManifest, build_manifest
from agent.protocol.sealed import seal

DEVICE = "dev-cfg"


def test_maps_merge_key_by_key_lists_replace_and_null_removes() -> None:
    base = {"labels": {"site": "a", "hw": "x"}, "streams": {"cam": {"fps_limit": 5, "rotate": 90}}}
    over = {"labels": {"site": "b", "hw": None}, "streams": {"cam": {"rotate": None}}, "slots": [1]}
    assert merge_overlay(base, over) == {
        "labels": {"site": "b"},
        "streams": {"cam": {"fps_limit": 5}},
        "slots": [1],
    }
    assert base["labels"] == {"site": "a", "hw": "x"}  # the base is not changed


class Device:
    """A base agent.yaml with a URL camera and the device's enrollment key, under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.key = ec.generate_private_key(ec.SECP256R1())
        key_file = root / "device.key"
        key_file.write_bytes(
            self.key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        model = write_classifier(root / "m.onnx", input_size=32, num_classes=4, seed=1)
        self.config = root / "agent.yaml"
        self.config.write_text(
            yaml.safe_dump(
                {
                    "device_id": DEVICE,
                    "state_dir": str(root / "state"),
                    "mqtt": {"host": "127.0.0.1", "tls": {"key_file": str(key_file)}},
                    "slots": {"cls": {"model": str(model), "postprocess": {"type": "classification"}}},
                    "streams": {"cam": {"source": {"type": "url", "url": "rtsp://op@cam/s"}, "slot": "cls"}},
                }
            )
        )
        self.target = ConfigTarget(
            self.config, root / "state", opener(key_file, DEVICE), _idle_agent(load_config(self.config))
        )
        self.n = 0

    def manifest(self, overlay: dict[str, Any] | str) -> tuple[Path, DeployManifest]:
        self.n += 1
        doc = self.root / f"overlay-{self.n}.yaml"
        doc.write_text(overlay if isinstance(overlay, str) else yaml.safe_dump(overlay))
        m = build_manifest(
            doc, job_id=f"j{self.n}", sequence=self.n, slot="_config", model_id="config", version=f"v{self.n}"
        )
        return doc, m


def _idle_agent(config: Any) -> RunningAgent:
    reading = HealthReading(True, frozenset(), frozenset(), frozenset())
    return RunningAgent(
        config=lambda: config,
        restart_keys=lambda _new: [],
        reload=lambda: None,
        restart=lambda: None,
        health=lambda: reading,
        started=threading.Event(),
    )


@pytest.fixture
def device(tmp_path: Path) -> Device:
    return Device(tmp_path)


@pytest.mark.parametrize(
    ("overlay", "named"),
    [
        ({"mqtt": {"host": "elsewhere"}}, "mqtt"),
        ({"device_id": "other"}, "device_id"),
        ({"delivery": {"trusted_keys": {}}}, "delivery.trusted_keys"),
        ({"delivery": {"require_signature": False}}, "delivery.require_signature"),
        ({"streams": {"cam": {"fps_limit": -1}}}, "streams.cam.fps_limit"),
        ({"streams": {"cam": {"slot": "nope"}}}, "streams.cam.slot"),
        ({"labels": {"site": "x"}, "telemetry": {"interval_s": "often"}}, "telemetry.interval_s"),
        ("[1, 2]", "mapping"),
        ("a: [", "YAML"),
    ],
)
def test_an_invalid_overlay_is_refused_naming_the_key(device: Device, overlay: Any, named: str) -> None:
    doc, m = device.manifest(overlay)
    with pytest.raises(ConfigInvalidError, match=named.replace(".", r"\.")) as caught:
        device.target.verify(doc, m)
    assert caught.value.code == "config_invalid"
    assert not (device.root / "state" / "config").exists()  # nothing written


def test_a_version_longer_than_up_info_carries_is_refused(device: Device) -> None:
    doc, m = device.manifest({"labels": {"site": "x"}})
    with pytest.raises(ConfigInvalidError, match="version"):
        device.target.verify(doc, m.model_copy(update={"version": "v" * 65}))


def test_a_sealed_password_becomes_a_0600_file_named_by_password_file(device: Device) -> None:
    clear = hashlib.sha256(str(device.root).encode()).hexdigest().encode()  # made at run time
    sealed = seal(clear, device.key.public_key(), DEVICE, "streams.cam.source.password")
    doc, m = device.manifest({"streams": {"cam": {"source": {"password": sealed}}}})
    device.target.verify(doc, m)
    device.target.install(doc, {}, m, JobReporter(lambda _f: None, threading.Event()))
    files = OverlayFiles(device.root / "state")
    stored = files.overlay_path(m.sha256).read_text()
    assert "sealed:" not in stored
    assert clear.decode() not in stored
    secret = files.secret_path(m.sha256, "streams.cam.source.password")
    assert secret.read_bytes() == clear
    assert secret.stat().st_mode & 0o777 == 0o600
    assert yaml.safe_load(stored)["streams"]["cam"]["source"]["password_file"] == str(secret)


def test_sealed_values_for_another_device_moved_or_tampered_are_config_invalid(device: Device) -> None:
    other = ec.generate_private_key(ec.SECP256R1())
    path = "streams.cam.source.password"
    good = seal(b"pw", device.key.public_key(), DEVICE, path)
    cases = [
        seal(b"pw", other.public_key(), DEVICE, path),  # sealed to another device's key
        seal(b"pw", device.key.public_key(), "someone-else", path),  # for another device id
        seal(b"pw", device.key.public_key(), DEVICE, "streams.other.source.password"),  # moved here
        good[:-4] + ("AAAA" if not good.endswith("AAAA") else "BBBB"),  # tampered
    ]
    for sealed in cases:
        doc, m = device.manifest({"streams": {"cam": {"source": {"password": sealed}}}})
        with pytest.raises(ConfigInvalidError, match=path.replace(".", r"\.")):
            device.target.verify(doc, m)
    doc, m = device.manifest({"labels": {"site": good}})  # a key that may not hold a sealed value
    with pytest.raises(ConfigInvalidError, match=r"labels\.site"):
        device.target.verify(doc, m)


def test_a_pending_overlay_the_agent_cannot_start_with_is_put_back(device: Device) -> None:
    files = OverlayFiles(device.root / "state")
    good = OverlayRef(version="good", job_id="j-good", sha256="a" * 64)
    bad = OverlayRef(version="bad", job_id="j-bad", sha256="b" * 64)
    files.write_overlay(good.sha256, {"labels": {"site": "good"}})
    files.write_overlay(bad.sha256, {"streams": {"cam": {"slot": "missing"}}})
    before = Reading(connected=True, streams_flowing=[], streams=[], slots_failing=[])
    pending = PendingChange(overlay=bad, restart=True, before=before)
    files.write(ConfigRecord(active=bad, last_good=good, pending=pending))
    config = starting_config(device.config)
    assert config.labels == {"site": "good"}
    record = files.read()
    assert record.active == good
    assert record.pending is None
    assert record.reverted is not None
    assert record.reverted.job_id == "j-bad"
    assert "streams.cam.slot" in record.reverted.reason


def test_a_change_the_agent_keeps_crashing_with_is_put_back(device: Device) -> None:
    files = OverlayFiles(device.root / "state")
    new = OverlayRef(version="new", job_id="j-new", sha256="c" * 64)
    files.write_overlay(new.sha256, {"labels": {"site": "new"}})
    before = Reading(connected=True, streams_flowing=[], streams=[], slots_failing=[])
    files.write(ConfigRecord(active=new, pending=PendingChange(overlay=new, restart=True, before=before)))
    for _ in range(MAX_PENDING_STARTS):
        assert starting_config(device.config).labels == {"site": "new"}
    assert starting_config(device.config).labels == {}
    record = files.read()
    assert record.active is None
    assert record.reverted is not None
    assert "without staying up" in record.reverted.reason


class Guard:
    """What the job runner's guard records: the states the target entered."""

    def __init__(self) -> None:
        self.entered: list[str] = []
        self.reporter = GuardReporter(
            lambda state: self.entered.append(state.value), lambda _s, _p: None, threading.Event()
        )


def test_each_step_notices_it_ran_for_the_job_the_resume_with_no_probation_window_since_already_confirmed(
    device: Device,
) -> None:
    doc, m = device.manifest({"labels": {"site": "east"}})
    reporter = JobReporter(lambda _f: None, threading.Event())
    device.target.verify(doc, m)
    device.target.install(doc, {}, m, reporter)
    files = OverlayFiles(device.root / "state")
    stored = files.overlay_path(m.sha256).stat().st_mtime_ns
    device.target.install(doc, {}, m, reporter)  # again after a restart: not written twice
    assert files.overlay_path(m.sha256).stat().st_mtime_ns == stored

    # Confirmed, then killed before the job's ACTIVE was recorded: resumed, it passes PROBATION and ends.
    ref = OverlayRef(version=m.version, job_id=m.job_id, sha256=m.sha256)
    files.write(ConfigRecord(active=ref, last_good=ref))
    device.config.write_text(device.config.read_text().replace("postprocess", "postprocessing"))
    device.target.verify(doc, m)  # checked before it was applied: not judged again by today's file
    guard = Guard()
    device.target.apply(doc, m.model_copy(update={"probation_s": 0.0}), guard.reporter)
    assert guard.entered == ["PROBATION"]
    assert files.read() == ConfigRecord(active=ref, last_good=ref)

    # Put back while the agent restarted: resumed, the job ends ROLLED_BACK config_reverted at once.
    files.write(ConfigRecord(reverted=Reverted(job_id=m.job_id, version=m.version, reason="no frames")))
    with pytest.raises(RolledBackError, match="no frames") as caught:
        device.target.apply(doc, m, Guard().reporter)
    assert caught.value.code == "config_reverted"


def test_a_live_change_found_unhealthy_is_put_back_by_a_reload(tmp_path: Path) -> None:
    """The running agent stands in here (its readings scripted: cam stops after the change); the
    real agent's reverts are tests/e2e/test_config_target.py's."""
    device = Device(tmp_path)
    flowing = HealthReading(True, frozenset({"cam"}), frozenset({"cam"}), frozenset())
    stalled = HealthReading(True, frozenset(), frozenset({"cam"}), frozenset())
    readings = iter([flowing, flowing, stalled, stalled])
    reloads: list[str] = []
    files = OverlayFiles(tmp_path / "state")
    started = threading.Event()
    started.set()
    target = ConfigTarget(
        device.config,
        tmp_path / "state",
        opener(None, DEVICE),
        RunningAgent(
            config=lambda: load_config(device.config),
            restart_keys=lambda _new: [],
            reload=lambda: reloads.append(getattr(files.read().active, "version", "none")),
            restart=lambda: None,
            health=lambda: next(readings),
            started=started,
        ),
        before_sample_s=0.0,
    )
    doc, m = device.manifest({"streams": {"cam": {"fps_limit": 2}}})
    m = m.model_copy(update={"probation_s": 0.0})
    target.verify(doc, m)
    target.install(doc, {}, m, JobReporter(lambda _f: None, threading.Event()))
    guard = Guard()
    with pytest.raises(RolledBackError, match="no frames on stream\\(s\\) cam") as caught:
        target.apply(doc, m, guard.reporter)
    assert caught.value.code == "config_reverted"
    assert guard.entered == ["PROBATION"]
    assert reloads == [m.version, "none"]  # applied, then put back (no overlay before it)
    record = files.read()
    assert record.active is None
    assert record.pending is None
    assert record.reverted is not None
    assert record.reverted.job_id == m.job_id
    assert target.info().reverted == record.reverted.reason
