"""Manifest building, signing and every way parse_signed refuses a payload (with its stable code)."""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path
from typing import Any

import pytest

from agent.demo.modelzoo import write_classifier
from agent.protocol.delivery_errors import RejectedError
from agent.protocol.manifest import (
    DeployManifest,
    ModelSourceRef,
    SignedManifest,
    build_manifest,
    parse_signed,
    recover_job_id,
    sign_manifest,
)
from agent.signing import (
    Ed25519PublicKey,
    generate_keypair,
    private_key_from_bytes,
    public_key_from_bytes,
    sign,
)
from agent.specs.build import BuildSpec
from agent.specs.postprocess import ClassificationSpec

DEVICE = "jet-01"


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_classifier(tmp_path / "m.onnx", input_size=32, seed=4)


@pytest.fixture
def keypair() -> tuple[Any, Ed25519PublicKey]:
    private_pem, public_pem = generate_keypair()
    return private_key_from_bytes(private_pem), public_key_from_bytes(public_pem)


def _manifest(model: Path, **kw: Any) -> DeployManifest:
    values: dict[str, Any] = {
        "job_id": "job-1",
        "sequence": 1,
        "slot": "main",
        "model_id": "cls",
        "version": "1.0",
    }
    values.update(kw)
    return build_manifest(model, chunk_size=4096, **values)


def test_build_manifest_hashes_whole_file_and_chunks(model: Path) -> None:
    import hashlib

    data = model.read_bytes()
    m = _manifest(model, postprocess=ClassificationSpec(labels=["a", "b"]))
    assert m.size == len(data)
    assert m.sha256 == hashlib.sha256(data).hexdigest()
    assert len(m.chunks) == math.ceil(len(data) / 4096)
    assert m.chunks[1] == hashlib.sha256(data[4096:8192]).hexdigest()
    assert m.chunk_length(len(m.chunks) - 1) == len(data) - 4096 * (len(m.chunks) - 1)
    assert m.sources == [ModelSourceRef(kind="mqtt")]


def test_signed_round_trip(model: Path, keypair: tuple[Any, Ed25519PublicKey]) -> None:
    private, public = keypair
    m = _manifest(model, device=DEVICE, postprocess=ClassificationSpec(labels=["cat", "dog"]))
    payload = sign_manifest(m, private, "k1")
    assert parse_signed(payload, {"k1": public}, True, DEVICE) == m
    envelope = json.loads(payload)
    assert set(envelope) == {"manifest", "key_id", "signature"}
    assert isinstance(envelope["manifest"], str)  # signed bytes travel verbatim


def _signed(private: Any, body: dict[str, Any] | str, key_id: str = "k1") -> bytes:
    text = body if isinstance(body, str) else json.dumps(body)
    sig = base64.b64encode(sign(private, text.encode())).decode()
    return SignedManifest(manifest=text, key_id=key_id, signature=sig).model_dump_json().encode()


def _refusal(payload: bytes, trusted: dict[str, Ed25519PublicKey], *, required: bool = True) -> RejectedError:
    with pytest.raises(RejectedError) as info:
        parse_signed(payload, trusted, required, DEVICE)
    return info.value


def test_every_refusal_has_its_code(model: Path, keypair: tuple[Any, Ed25519PublicKey]) -> None:
    private, public = keypair
    trusted = {"k1": public}
    m = _manifest(model)
    body = m.model_dump(mode="json")
    good = sign_manifest(m, private, "k1")

    cases: list[tuple[bytes, str, str]] = [
        (b"\xff\xfe not json", "bad_json", "not valid JSON"),
        (b"[1, 2]", "bad_manifest", "JSON object"),
        (b'{"manifest": 7}', "bad_manifest", "manifest"),
        (b'{"manifest": "{}", "extra": 1}', "bad_manifest", "extra"),
        (_signed(private, "{not json"), "bad_json", "manifest string"),
        (
            _signed(private, {**body, "chunks": body["chunks"][:-1]}),
            "bad_manifest",
            "manifest: Value error, chunks",
        ),
        (_signed(private, {**body, "sources": []}), "bad_manifest", "manifest.sources"),
        (
            _signed(private, {**body, "sources": [{"kind": "http"}]}),
            "bad_manifest",
            "http source needs a url",
        ),
        (_signed(private, {**body, "sequence": 0}), "bad_manifest", "manifest.sequence"),
        (_signed(private, {**body, "sha256": "XYZ"}), "bad_manifest", "manifest.sha256"),
        (_signed(private, {**body, "chunk_size": 100}), "bad_manifest", "manifest.chunk_size"),
        (_signed(private, {k: v for k, v in body.items() if k != "size"}), "bad_manifest", "manifest.size"),
        (good.replace(b"job-1", b"job-2"), "bad_signature", "does not match"),
        (good.replace(b'"signature":"', b'"signature":"!!'), "bad_signature", "base64"),
        (_signed(private, body, key_id="k2"), "unknown_key", "'k2'"),
        (sign_manifest(m, None, None), "unsigned", "require_signature"),
        (_signed(private, {**body, "slot": "../../etc"}), "bad_name", "manifest.slot"),
        (_signed(private, {**body, "model_id": "a/b"}), "bad_name", "path separator"),
        (_signed(private, {**body, "model_id": "a\\b"}), "bad_name", "path separator"),
        (_signed(private, {**body, "version": ".."}), "bad_name", "'..'"),
        (_signed(private, {**body, "job_id": "job/1"}), "bad_name", "manifest.job_id"),
        (_signed(private, {**body, "job_id": "job+1"}), "bad_name", "manifest.job_id"),
        (_signed(private, {**body, "device": "jet-02"}), "wrong_device", "jet-02"),
    ]
    for payload, code, words in cases:
        exc = _refusal(payload, trusted)
        assert exc.code == code, (payload[:80], str(exc))
        assert words in str(exc), (code, str(exc))


def test_bad_name_quotes_the_value_it_refuses(model: Path, keypair: tuple[Any, Ed25519PublicKey]) -> None:
    private, public = keypair
    body = _manifest(model).model_dump(mode="json")
    for field, value in (("model_id", "a/b"), ("version", ".."), ("job_id", "job+1"), ("slot", "x/../y")):
        exc = _refusal(_signed(private, {**body, field: value}), {"k1": public})
        assert exc.code == "bad_name"
        assert f"{field} {value!r} " in str(exc), str(exc)
        assert "{value" not in str(exc), str(exc)


def test_unsigned_accepted_only_when_not_required(model: Path, keypair: tuple[Any, Ed25519PublicKey]) -> None:
    m = _manifest(model)
    assert parse_signed(sign_manifest(m, None, None), {}, False, DEVICE) == m
    # A signature that is present is checked even when signatures are not required.
    private, _ = keypair
    assert _refusal(sign_manifest(m, private, "k9"), {}, required=False).code == "unknown_key"


def test_job_id_recovered_for_rejection_reports(model: Path, keypair: tuple[Any, Ed25519PublicKey]) -> None:
    private, public = keypair
    m = _manifest(model, job_id="job-77")
    assert recover_job_id(sign_manifest(m, private, "k1")) == "job-77"
    assert recover_job_id(m.model_dump_json().encode()) == "job-77"  # a bare manifest, unwrapped
    assert recover_job_id(b"nonsense") is None
    assert recover_job_id(b'{"manifest": "{\\"job_id\\": \\"a/b\\"}"}') is None  # not a usable topic level
    exc = _refusal(sign_manifest(m, private, "k1").replace(b"job-77", b"job-78"), {"k1": public})
    assert exc.job_id == "job-78"


def test_a_signed_manifest_carries_only_the_build_keys_that_were_set(tmp_path: Path) -> None:
    """An older agent refuses unknown keys: defaults it may not know must not travel."""
    model = tmp_path / "m.onnx"
    model.write_bytes(b"\0" * 4096)
    manifest = build_manifest(
        model, job_id="j1", sequence=1, slot="main", model_id="m", version="1",
        build=BuildSpec(precision="int8", device="dla0"),
    )  # fmt: skip
    envelope = json.loads(sign_manifest(manifest, None, None))
    sent = json.loads(envelope["manifest"])
    assert sent["build"] == {"precision": "int8", "device": "dla0"}
    # The device reads it back as the whole spec, its own defaults filled in.
    parsed = parse_signed(json.dumps(envelope).encode(), {}, False, "dev-1")
    assert parsed.build == BuildSpec(precision="int8", device="dla0")


def test_a_null_inside_shadow_or_probation_reaches_the_device_as_null(tmp_path: Path) -> None:
    """``min_agreement: null`` (classes changed on purpose) must not become the device's default."""
    from agent.protocol.proving import ProbationSpec, ShadowSpec

    model = tmp_path / "m.onnx"
    model.write_bytes(b"\0" * 4096)
    manifest = build_manifest(
        model, job_id="j1", sequence=1, slot="main", model_id="m", version="1",
        shadow=ShadowSpec(min_agreement=None), probation_s=30.0,
        probation=ProbationSpec(max_class_shift=None),
    )  # fmt: skip
    parsed = parse_signed(sign_manifest(manifest, None, None), {}, False, "dev-1")
    assert parsed.shadow is not None
    assert parsed.shadow.min_agreement is None
    assert parsed.probation is not None
    assert parsed.probation.max_class_shift is None


def test_a_way_back_carries_no_shadow_and_no_probation(model: Path) -> None:
    """A manifest marked ``rollback`` that asked for either would judge the way back against, or swap
    back to, the model being left: refused with the reason."""
    from agent.protocol.proving import ShadowSpec

    assert _manifest(model, rollback=True).rollback is True
    with pytest.raises(ValueError, match="rollback: a way back has no shadow and no probation"):
        _manifest(model, rollback=True, probation_s=30.0)
    with pytest.raises(ValueError, match="rollback: a way back has no shadow and no probation"):
        _manifest(model, rollback=True, shadow=ShadowSpec())
