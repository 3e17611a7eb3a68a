"""The controller's engine desk: offer, upload in pieces, vouch, list; every device's words bounded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.fleet.engines.desk import MAX_REQUEST_BYTES, EngineDesk, EngineRequestError
from agent.fleet.engines.settings import EngineShareSettings
from agent.mqtt.core import PublishProperties
from agent.mqtt.inbound import InboundMessage
from agent.protocol.engines import EngineAsk
from agent.protocol.messages import CommandReply, decode
from agent.protocol.topics import Topics
from agent.signing import Ed25519PrivateKey
from tests.engines.fleet_desk import make_desk
from tests.fleet.engines.records import offer

KEY_B = "b" * 64


@pytest.fixture
def desk(tmp_path: Path) -> EngineDesk:
    return make_desk(tmp_path, Ed25519PrivateKey.generate(), settings=EngineShareSettings(max_uploads=1))


def upload(desk: EngineDesk, device: str, data: bytes) -> dict[str, object]:
    made = offer(data=data)
    first = desk.handle(device, "offer", made.model_dump_json().encode(), {})
    assert first == {"stored": False, "want": [made.files[0].sha256]}
    properties = {"sha256": made.files[0].sha256, "offset": "0", "size": str(len(data))}
    assert desk.handle(device, "piece", data, properties) == {"have": len(data), "complete": True}
    return desk.handle(device, "offer", made.model_dump_json().encode(), {})


def test_an_offered_engine_is_uploaded_in_pieces_vouched_for_and_listed_per_fingerprint(
    desk: EngineDesk,
) -> None:
    assert upload(desk, "dev-a", b"engine bytes") == {"stored": True}
    found = desk.handle("dev-b", "ask", EngineAsk(key="a" * 64).model_dump_json().encode(), {})
    assert found["found"] is True
    listing = desk.listing()
    (rows,) = listing["fingerprints"].values()
    assert [(r["built_by"], r["reuse"], r["bytes"]) for r in rows] == [("dev-a", 1, len(b"engine bytes"))]
    assert listing["sharing"] is True
    assert desk.handle("dev-c", "offer", offer(data=b"engine bytes").model_dump_json().encode(), {}) == {
        "stored": True,
        "note": "the fleet holds this engine already",
    }


def test_a_piece_without_an_offer_or_of_another_size_is_refused(desk: EngineDesk) -> None:
    with pytest.raises(EngineRequestError, match="offer first"):
        desk.handle("dev-a", "piece", b"x", {"sha256": "c" * 64, "offset": "0", "size": "1"})
    made = offer(data=b"engine bytes")
    desk.handle("dev-a", "offer", made.model_dump_json().encode(), {})
    with pytest.raises(EngineRequestError, match="not the offered one"):
        desk.handle("dev-a", "piece", b"x", {"sha256": made.files[0].sha256, "offset": "0", "size": "99"})
    with pytest.raises(EngineRequestError, match="offer first"):  # another device's upload is not its
        desk.handle("dev-b", "piece", b"x", {"sha256": made.files[0].sha256, "offset": "0", "size": "12"})


def test_uploads_in_progress_are_bounded(desk: EngineDesk) -> None:
    desk.handle("dev-a", "offer", offer(data=b"one engine").model_dump_json().encode(), {})
    with pytest.raises(EngineRequestError, match="busy"):
        desk.handle("dev-b", "offer", offer(key=KEY_B, data=b"another").model_dump_json().encode(), {})


def test_an_oversized_or_malformed_request_or_unknown_verb_is_refused(desk: EngineDesk) -> None:
    with pytest.raises(EngineRequestError, match="more than"):
        desk.handle("dev-a", "offer", b"x" * (MAX_REQUEST_BYTES + 1), {})
    with pytest.raises(ValueError, match="validation error"):
        desk.handle("dev-a", "ask", b'{"key": "not a key"}', {})
    with pytest.raises(EngineRequestError, match="unknown engines verb"):
        desk.handle("dev-a", "gimme", b"{}", {})


def test_a_reply_goes_to_the_asking_devices_own_topic_only(tmp_path: Path) -> None:
    sent: list[tuple[str, bytes, PublishProperties]] = []
    desk = make_desk(tmp_path, Ed25519PrivateKey.generate())
    desk._publish = lambda topic, payload, props: sent.append((topic, payload, props))
    own = Topics("fleet/v1", "dev-a")
    ask = EngineAsk(key="a" * 64).model_dump_json().encode()

    def request(response_topic: str) -> InboundMessage:
        return InboundMessage(
            topic=own.engines_request("ask"),
            payload=ask,
            qos=1,
            retain=False,
            response_topic=response_topic,
            correlation_data=b"c1",
        )

    desk._answer(request(Topics("fleet/v1", "dev-b").engines_reply))
    assert sent == []
    desk._answer(request(own.engines_reply))
    ((topic, payload, props),) = sent
    assert (topic, props.correlation_data) == (own.engines_reply, b"c1")
    result = decode(CommandReply, payload).result or {}
    assert (result["found"], result["build"]) == (False, True)  # the first asker is told to build it
    assert result["reason"].startswith(f"the fleet holds no engine {'a' * 12}")


def test_an_offer_with_an_oversized_sidecar_or_repeated_file_names_is_refused(desk: EngineDesk) -> None:
    made = offer()
    huge = made.model_dump(mode="json")
    huge["meta"] = {"engine_file": "model.onnx", "extra": {"x": "y" * 70_000}}
    with pytest.raises(ValueError, match="more than"):
        desk.handle("dev-a", "offer", json.dumps(huge).encode(), {})
    twice = made.model_dump(mode="json")
    twice["files"] = twice["files"] * 2
    with pytest.raises(ValueError, match="repeat"):
        desk.handle("dev-a", "offer", json.dumps(twice).encode(), {})
