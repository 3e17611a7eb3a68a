"""``fleet engines list``'s text: a heading per fingerprint, a line per engine with who built it and
how often it was reused (the JSON is the controller's answer, checked end to end)."""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path
from typing import Any

from agent.fleet.engines.hooks import engines_listing
from agent.fleet.engines.listing import engines_table
from agent.fleet.engines.store import INDEX_FILE, MAX_NOTE_CHARS
from agent.protocol.engines import EngineAsk
from agent.signing import Ed25519PrivateKey
from tests.engines.fleet_desk import make_desk
from tests.fleet.engines.records import KEY, offer, store_engine


def test_the_table_shows_each_fingerprints_engines_with_builder_and_reuse(tmp_path: Path) -> None:
    desk = make_desk(tmp_path, Ed25519PrivateKey.generate())
    meta = {**offer().meta, "identity": {"precision": "int8"}}
    made = store_engine(desk, "jet-01", b"engine bytes", key=KEY, model_id="shapes", version="2", meta=meta)
    desk.store.used(made.key, "jet-02")
    listing = desk.listing()
    lines = engines_table(listing).splitlines()
    assert lines[0] == "engines: 1 (12 B), sharing on"
    assert lines[1] == "onnxruntime 1.20 / x86_64 / cpu:"
    assert lines[2].split()[:4] == ["KEY", "MODEL", "VERSION", "PREC"]
    # Per key: the model and version its builder's job deployed, the precision it was built at.
    assert lines[3].split()[:6] == [made.key[:12], "shapes", "2", "int8", "12", "B"]
    assert "jet-01" in lines[3]
    assert lines[3].split()[-2:] == ["3s", "1"]  # build seconds, downloads by other devices
    (row,) = listing["fingerprints"]["onnxruntime 1.20 / x86_64 / cpu"]
    assert (row["model_id"], row["version"], row["precision"]) == ("shapes", "2", "int8")


def test_a_claim_shows_the_model_version_and_precision_its_builder_asked_for(tmp_path: Path) -> None:
    desk = make_desk(tmp_path, Ed25519PrivateKey.generate())
    ask = EngineAsk(key=KEY, job_id="j1", fingerprint="fp", model_id="shapes", version="3", precision="fp16")
    assert desk.handle("jet-01", "ask", ask.model_dump_json().encode(), {})["build"] is True
    listing = desk.listing()
    (claim,) = listing["claims"]
    assert (claim["model_id"], claim["version"], claim["precision"]) == ("shapes", "3", "fp16")
    line = engines_table(listing).splitlines()[-1]
    assert line.split()[:5] == [KEY[:12], "shapes", "3", "fp16", "jet-01"]


def test_an_unsigned_controller_says_it_shares_nothing(tmp_path: Path) -> None:
    assert (
        engines_table(make_desk(tmp_path, None).listing()) == "engines: 0 (0 B), sharing off (no signing key)"
    )


def test_the_example_in_docs_fleet_md_is_what_the_table_prints() -> None:
    doc = (Path(__file__).resolve().parents[3] / "docs" / "fleet.md").read_text()
    shown = doc.split("$ edge-agent fleet engines list\n", 1)[1].split("```", 1)[0].rstrip("\n")
    mib = 1024**2
    built = 1772366650.0  # 2026-03-01 12:04:10 UTC

    def row(
        key: str, size: float, by: str, at: float, took: float, reuse: int, platform: str
    ) -> dict[str, object]:
        fields = {"key": key * 6, "fingerprint": platform, "bytes": int(size * mib), "built_by": by}
        model = {"model_id": "yolo", "version": "8", "precision": "fp16"}
        return {**fields, "built_at": at, "build_seconds": took, "reuse": reuse, "last_used": at, **model}

    gpu = "tensorrt 10.3.0 / Orin 8.7 / gpu / L4T R36.4.3"
    dla = "tensorrt 10.3.0 / Orin 8.7 / dla / L4T R36.4.3"
    listing = {
        "engines": 2,
        "bytes": int(18.2 * mib) + int(18.1 * mib),
        "sharing": True,
        "signed": True,
        "fingerprints": {
            gpu: [row("5c1e0f3a9b7d", 18.2, "jet-b1", built, 312.0, 41, gpu)],
            dla: [row("9a8b7c6d5e4f", 18.1, "jet-b2", built + 345, 401.0, 40, dla)],
        },
    }
    assert engines_table(listing) == shown


def test_withdrawn_engines_are_listed_after_the_held_ones(tmp_path: Path) -> None:
    desk = make_desk(tmp_path, Ed25519PrivateKey.generate())
    made = store_engine(desk, "jet-01", b"engine bytes", key=KEY)
    assert desk.store.withdraw(made.key, "failed to load on jet-02")
    listing = engines_listing(desk)
    lines = engines_table(listing).splitlines()

    assert listing["engines"] == 0
    [row] = listing["withdrawn"]
    at = row.pop("at")
    assert row == {
        "key": made.key,
        "engine_sha256": made.files[0].sha256,
        "fingerprint": made.fingerprint,
        "built_by": "jet-01",
        "reason": "failed to load on jet-02",
    }
    assert listing["withdrawn_total"] == 1
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at))
    assert lines[-2:] == [
        "withdrawn (never taken again): 1",
        f"  {made.key[:12]}  engine {made.files[0].sha256[:12]}  built by jet-01 on {made.fingerprint};"
        f" withdrawn {when}: failed to load on jet-02",
    ]
    # The note outlives a restart (it is in index.json), and an index written before notes existed
    # still loads (its withdrawn engines are listed by key and engine alone).
    again = make_desk(tmp_path, Ed25519PrivateKey.generate())
    assert engines_listing(again)["withdrawn"][0]["reason"] == "failed to load on jet-02"
    index = tmp_path / INDEX_FILE
    old = json.loads(index.read_text())
    del old["withdrawn_notes"]
    index.write_text(json.dumps(old))
    older = make_desk(tmp_path, Ed25519PrivateKey.generate())
    assert engines_listing(older)["withdrawn"] == [{"key": made.key, "engine_sha256": made.files[0].sha256}]


def test_a_withdrawal_note_from_a_hostile_device_is_bounded_and_printed_escaped(tmp_path: Path) -> None:
    desk = make_desk(tmp_path, Ed25519PrivateKey.generate())
    made = store_engine(desk, "jet\x1b[2J", b"engine bytes", key=KEY)
    assert desk.store.withdraw(made.key, "jet-02: load: " + "\x1b[2J" * 200)
    [note] = desk.store.withdrawn_notes()
    assert len(note.reason) == MAX_NOTE_CHARS
    text = engines_table(engines_listing(desk))
    assert "\x1b" not in text


def test_a_builder_id_or_fingerprint_with_control_characters_is_printed_escaped() -> None:
    row = {"key": "ab" * 32, "bytes": 10, "built_by": "jet\x1b[2J", "built_at": 0.0, "reuse": 0}
    listing = {"engines": 1, "bytes": 10, "sharing": True, "fingerprints": {"trt\u202e10": [row]}}
    text = engines_table(listing)
    assert "\x1b" not in text
    assert "\u202e" not in text
    assert "trt\\u202e10:" in text
    assert "jet\\x1b[2J" in text


def test_the_engine_listing_example_in_docs_protocol_md_has_the_keys_of_a_real_listing(
    tmp_path: Path,
) -> None:
    desk = make_desk(tmp_path, Ed25519PrivateKey.generate())
    for device, data in (("jet-01", b"engine bytes"), ("jet-02", b"other bytes!")):
        store_engine(desk, device, data)
    desk.store.withdraw(hashlib.sha256(b"other bytes!").hexdigest(), "failed to load")
    ask = EngineAsk(key="cd" * 32, job_id="j-3", fingerprint="tensorrt 10.3.0 / Orin 8.7 / gpu / L4T R36.4.3")
    desk.handle("jet-03", "ask", ask.model_dump_json().encode(), {})
    real = engines_listing(desk)
    doc = (Path(__file__).resolve().parents[3] / "docs" / "protocol.md").read_text()
    section = doc.split("\n### Engine listing\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```json\n(.*?)```", section, re.S)
    example = json.loads(block)

    def rows(listing: dict[str, Any]) -> list[dict[str, Any]]:
        return [row for found in listing["fingerprints"].values() for row in found]

    assert set(example) == set(real)
    assert [set(r) for r in rows(example)] == [set(r) for r in rows(real)]
    assert [set(w) for w in example["withdrawn"]] == [set(w) for w in real["withdrawn"]]
    assert [set(c) for c in example["claims"]] == [set(c) for c in real["claims"]]
    assert engines_table(example).splitlines()[0] == "engines: 1 (18.2 MiB), sharing on"
    # docs/fleet.md's withdrawn line is what the table prints for this example.
    fleet_doc = (Path(__file__).resolve().parents[3] / "docs" / "fleet.md").read_text()
    [withdrawn_line] = [line for line in engines_table(example).splitlines() if "built by" in line]
    assert f"`{withdrawn_line}`" in fleet_doc


def test_the_table_shows_the_builds_claimed_and_who_waits_for_them(tmp_path: Path) -> None:
    desk = make_desk(tmp_path, Ed25519PrivateKey.generate())
    ask = EngineAsk(key="ab" * 32, fingerprint="tensorrt 10.3.0 / Orin NX 8.7 / gpu / L4T R36.4.0")
    for device in ("jet-01", "jet-02", "jet-03"):
        desk.handle(device, "ask", ask.model_dump_json().encode(), {})
    listing = desk.listing()
    (claim,) = listing["claims"]
    assert (claim["device"], claim["waiting"], claim["key"]) == ("jet-01", 2, "ab" * 32)
    lines = engines_table(listing).splitlines()
    assert lines[1] == "being built now (build claims): 1"
    assert lines[3].split()[:5] == ["ab" * 6, "-", "-", "-", "jet-01"]  # the asks named no model
    assert lines[3].endswith("2  tensorrt 10.3.0 / Orin NX 8.7 / gpu / L4T R36.4.0")
