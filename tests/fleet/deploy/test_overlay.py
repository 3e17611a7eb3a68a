"""A configuration overlay on the operator side: its keys checked, secrets sealed, changes shown."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from agent.errors import ConfigError
from agent.fleet.deploy.overlay import (
    SEALED_SHOWN,
    dump_overlay,
    overlay_changes,
    parse_overlay,
    read_overlay,
    with_sealed,
)
from agent.protocol.sealed import SealedValueError, open_sealed


def test_an_overlay_of_documented_keys_is_taken(tmp_path: Path) -> None:
    path = tmp_path / "overlay.yaml"
    path.write_text("streams:\n  door:\n    fps_limit: 5\ntelemetry:\n  interval_s: 30\n")
    assert read_overlay(path) == {"streams": {"door": {"fps_limit": 5}}, "telemetry": {"interval_s": 30}}


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("mqtt:\n  host: elsewhere\n", "mqtt: not a key an overlay sets"),
        ("device_id: other\n", "device_id: not a key an overlay sets"),
        ("delivery:\n  trusted_keys: {}\n", "delivery.trusted_keys: decides whom the device trusts"),
        ("delivery:\n  require_signature: false\n", "delivery.require_signature: decides whom"),
        ("delivery:\n  trust_root: /tmp/root.json\n", "delivery.trust_root: decides whom"),
    ],
)
def test_a_key_an_overlay_may_not_set_is_refused_by_name(text: str, named: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_overlay(text.encode(), "overlay.yaml")
    assert any(named in p for p in caught.value.problems), caught.value.problems


def test_a_secret_written_in_clear_is_refused_naming_the_key_and_how_to_seal_it() -> None:
    password = secrets.token_urlsafe(8)
    text = f"streams:\n  door:\n    password: {password}\n    password_file: /run/door\n"
    with pytest.raises(ConfigError) as caught:
        parse_overlay(text.encode(), "overlay.yaml")
    assert caught.value.problems == [
        "streams.door.password: a secret in clear; seal it to the device: "
        "`fleet config set --secret streams.door.password=@FILE`"
    ]
    with pytest.raises(ConfigError) as caught:
        parse_overlay(f"streams:\n  door:\n    url: rtsp://op:{password}@cam/1\n".encode(), "overlay.yaml")
    assert "streams.door.url: a password in the URL" in caught.value.problems[0]
    assert password not in repr(caught.value.problems)
    # Sealed, or a path to a secret file, or a URL without a password: taken.
    parse_overlay(b"streams:\n  door:\n    url: rtsp://op@cam/1\n    password_file: /run/door\n", "o")


def test_an_overlay_that_is_not_a_mapping_or_too_large_is_refused() -> None:
    with pytest.raises(ConfigError, match="a mapping"):
        parse_overlay(b"- a\n- b\n", "overlay.yaml")
    with pytest.raises(ConfigError, match="more than the"):
        parse_overlay(b"labels: {}\n" + b"#" * (256 * 1024), "overlay.yaml")


def test_a_sealed_secret_opens_only_with_the_devices_key_under_its_own_key() -> None:
    device_key = ec.generate_private_key(ec.SECP256R1())
    password = secrets.token_urlsafe(16).encode()
    data = with_sealed(
        {"streams": {"door": {"fps_limit": 5}}},
        "streams.door.password",
        password,
        device_key.public_key(),
        "jet-1",
    )
    sealed = data["streams"]["door"]["password"]
    assert password not in dump_overlay(data)
    assert open_sealed(sealed, device_key, "jet-1", "streams.door.password") == password
    with pytest.raises(SealedValueError):
        open_sealed(sealed, device_key, "jet-2", "streams.door.password")  # another device's overlay
    with pytest.raises(SealedValueError):
        open_sealed(sealed, device_key, "jet-1", "streams.yard.password")  # moved to another key
    with pytest.raises(SealedValueError):
        open_sealed(sealed, ec.generate_private_key(ec.SECP256R1()), "jet-1", "streams.door.password")


def test_a_secret_is_not_sealed_under_a_key_an_overlay_may_not_set() -> None:
    key = ec.generate_private_key(ec.SECP256R1()).public_key()
    with pytest.raises(ConfigError, match="mqtt"):
        with_sealed({}, "mqtt.password", b"x", key, "jet-1")
    with pytest.raises(ConfigError, match="not a dotted key"):
        with_sealed({}, "streams..password", b"x", key, "jet-1")


def test_the_changes_show_every_key_and_never_a_secret() -> None:
    key = ec.generate_private_key(ec.SECP256R1()).public_key()
    url_password = secrets.token_hex(6)
    old = {"streams": {"door": {"fps_limit": 5, "url": "rtsp://cam/1"}}, "labels": {"site": "a"}}
    new = with_sealed(
        {
            "streams": {"door": {"fps_limit": 10, "url": f"rtsp://op:{url_password}@cam/1"}},
            "telemetry": {"api_token": "t-" + url_password},
        },
        "streams.door.password",
        b"hunter",
        key,
        "jet-1",
    )
    changes = {c.key: c for c in overlay_changes(old, new)}
    assert set(changes) == {
        "streams.door.fps_limit",
        "streams.door.url",
        "streams.door.password",
        "labels.site",
        "telemetry.api_token",
    }
    assert (changes["streams.door.fps_limit"].old, changes["streams.door.fps_limit"].new) == (5, 10)
    assert changes["streams.door.password"].new == SEALED_SHOWN
    assert not changes["streams.door.password"].had_old
    assert changes["labels.site"].has_new is False
    shown = repr([c.shown() for c in changes.values()])
    assert url_password not in shown
    assert "op:***@cam" in shown
