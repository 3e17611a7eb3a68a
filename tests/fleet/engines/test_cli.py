"""``fleet engines list``'s text: a heading per fingerprint, a line per engine with who built it and
how often it was reused (the JSON is the controller's answer, checked end to end)."""

from __future__ import annotations

from pathlib import Path

from agent.fleet.engines.cli import engines_table
from agent.signing import Ed25519PrivateKey
from tests.engines.fleet_desk import make_desk
from tests.fleet.engines.records import offer


def test_the_table_shows_each_fingerprints_engines_with_builder_and_reuse(tmp_path: Path) -> None:
    desk = make_desk(tmp_path, Ed25519PrivateKey.generate())
    made = offer(data=b"engine bytes")
    desk.handle("jet-01", "offer", made.model_dump_json().encode(), {})
    properties = {"sha256": made.files[0].sha256, "offset": "0", "size": "12"}
    desk.handle("jet-01", "piece", b"engine bytes", properties)
    desk.handle("jet-01", "offer", made.model_dump_json().encode(), {})
    desk.store.used(made.key, "jet-02")
    lines = engines_table(desk.listing()).splitlines()
    assert lines[0] == "engines: 1 (12 B), sharing on"
    assert lines[1] == "onnxruntime 1.20 / x86_64 / cpu:"
    assert lines[3].split()[:3] == [made.key[:12], "12", "B"]
    assert "jet-01" in lines[3]
    assert lines[3].split()[-2:] == ["3s", "1"]  # build seconds, downloads by other devices


def test_an_unsigned_controller_says_it_shares_nothing(tmp_path: Path) -> None:
    assert (
        engines_table(make_desk(tmp_path, None).listing()) == "engines: 0 (0 B), sharing off (no signing key)"
    )
