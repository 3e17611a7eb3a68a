"""Engine cache key (stable, sensitive to every input, order-independent) and the sidecar JSON."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from agent.engines.building.plan import PlatformFacts, plan_build
from agent.engines.cache.key import (
    KEY_SCHEMA,
    PLAN_FIELDS_NOT_IN_KEY,
    SIDECAR_NAME,
    EngineIdentity,
    EngineMeta,
    calibration_sha256,
    engine_cache_key,
    external_data_files,
    model_sha256,
    new_engine_meta,
    read_sidecar,
    write_sidecar,
)
from agent.errors import BuildError
from agent.machine.platform import Platform
from agent.specs.build import BuildPlan, BuildSpec, EngineOptions, ShapeProfile
from tests.waiting import patient

SHA_A = "a" * 64
SHA_B = "b" * 64

BASE: dict[str, Any] = {
    "model_sha256": SHA_A,
    "backend": "tensorrt",
    "backend_version": "10.3.0",
    "gpu_name": "Orin",
    "compute_capability": "8.7",
    "l4t_release": "R36.4.0",
    "cuda_version": "12.6",
    "machine": "aarch64",
    "precision": "int8",
    "device": "dla",
    "dla_core": 0,
    "gpu_fallback": True,
    "int8_mode": "calibrator",
    "allow_fp16": True,
    "workspace_mb": 1024,
    "dla_sram_mb": None,
    "dla_local_dram_mb": None,
    "dla_global_dram_mb": None,
    "optimization_level": 3,
    "profiles": (ShapeProfile(input="images", min=(1, 3, 8, 8), opt=(1, 3, 8, 8), max=(1, 3, 8, 8)),),
    "calibration_sha256": SHA_B,
    "extra": {"plugins": "none"},
}

# One different value for every field of the identity.
VARIANTS: dict[str, Any] = {
    "key_schema": KEY_SCHEMA + 1,
    "model_sha256": "c" * 64,
    "backend": "onnxruntime",
    "backend_version": "10.3.0.30",
    "gpu_name": "Orin (nvgpu)",
    "compute_capability": "8.6",
    "l4t_release": "R36.4.3",
    "cuda_version": "12.2",
    "machine": "x86_64",
    "precision": "fp16",
    "device": "gpu",
    "dla_core": 1,
    "gpu_fallback": False,
    "int8_mode": "qdq",
    "allow_fp16": False,
    "workspace_mb": 2048,
    "dla_sram_mb": 1,
    "dla_local_dram_mb": 512,
    "dla_global_dram_mb": 256,
    "optimization_level": 5,
    "profiles": (ShapeProfile(input="images", min=(2, 3, 8, 8), opt=(2, 3, 8, 8), max=(2, 3, 8, 8)),),
    "slim": False,
    "ep_context": "file",
    "trt_context_memory_sharing": True,
    "trt_auxiliary_streams": 0,
    "calibration_sha256": None,
    "extra": {"plugins": "libnms.so:" + "d" * 8},
}


def spec(**fields: Any) -> BuildSpec:
    return BuildSpec.model_validate(fields)


def identity(**changes: Any) -> EngineIdentity:
    return EngineIdentity(**{**BASE, **changes})


def test_every_field_has_a_variant() -> None:
    assert set(VARIANTS) == set(EngineIdentity.model_fields)


@pytest.mark.parametrize("field", sorted(VARIANTS))
def test_any_one_input_change_changes_the_key(field: str) -> None:
    assert engine_cache_key(identity(**{field: VARIANTS[field]})) != engine_cache_key(identity())


def test_key_is_sha256_hex_and_deterministic() -> None:
    key = engine_cache_key(identity())
    assert len(key) == 64
    assert int(key, 16) >= 0
    assert engine_cache_key(identity()) == key


def test_key_independent_of_dict_and_profile_order() -> None:
    a = ShapeProfile(input="a", min=(1,), opt=(1,), max=(1,))
    b = ShapeProfile(input="b", min=(2,), opt=(2,), max=(2,))
    one = identity(extra={"x": "1", "y": "2"}, profiles=(a, b))
    two = identity(extra={"y": "2", "x": "1"}, profiles=(b, a))
    assert engine_cache_key(one) == engine_cache_key(two)
    # Same field values built in another keyword order.
    reordered = EngineIdentity(**dict(reversed(list({**BASE}.items()))))
    assert engine_cache_key(reordered) == engine_cache_key(identity())


def test_key_stable_across_processes() -> None:
    """A fresh interpreter (other hash seed) computes the same key."""
    code = (
        "from agent.engines.cache.key import EngineIdentity, engine_cache_key;"
        f"print(engine_cache_key(EngineIdentity.model_validate_json({identity().model_dump_json()!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=patient(60),
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
        cwd=Path(__file__).resolve().parents[3],
    )
    assert out.stdout.strip() == engine_cache_key(identity())


def test_key_pinned_value() -> None:
    """The canonical form is part of the contract: changing it must bump KEY_SCHEMA."""
    minimal = EngineIdentity(
        model_sha256=SHA_A,
        backend="onnxruntime",
        backend_version="1.31.1",
        precision="fp32",
        device="cpu",
        workspace_mb=1024,
        optimization_level=3,
    )
    data = minimal.model_dump(mode="json")
    expected = hashlib.sha256(
        json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    ).hexdigest()
    assert engine_cache_key(minimal) == expected


def test_identity_for_build_from_plan_and_platform() -> None:
    platform = Platform(
        is_jetson=True,
        machine="aarch64",
        l4t_release="R36.4.0",
        cuda_runtime="12.6",
        gpu_name="Orin",
        compute_capability="8.7",
        tensorrt_version="10.3.0",
        onnxruntime_version="1.31.1",
    )
    facts = PlatformFacts("10.3.0", 2, True)
    plan = plan_build(spec(device="dla1", precision="fp16"), facts, model_static=True)
    ident = EngineIdentity.for_build(model_sha256=SHA_A, plan=plan, platform=platform)
    assert (ident.backend, ident.backend_version, ident.device, ident.dla_core) == (
        "tensorrt",
        "10.3.0",
        "dla",
        1,
    )
    assert (ident.l4t_release, ident.cuda_version, ident.compute_capability) == ("R36.4.0", "12.6", "8.7")
    other_core = EngineIdentity.for_build(
        model_sha256=SHA_A,
        plan=plan_build(spec(device="dla0", precision="fp16"), facts, model_static=True),
        platform=platform,
    )
    assert engine_cache_key(ident) != engine_cache_key(other_core)


def test_identity_for_build_needs_backend_version() -> None:
    plan = plan_build(spec(device="cpu", precision="fp32"), PlatformFacts(None, 0, False), model_static=True)
    with pytest.raises(BuildError, match="onnxruntime version"):
        EngineIdentity.for_build(model_sha256=SHA_A, plan=plan, platform=Platform())


def test_identity_takes_every_plan_field_but_the_listed_ones() -> None:
    """The key's plan part is the plan's engine options, whole: nothing copied field by field."""
    keyed = set(BuildPlan.model_fields) - PLAN_FIELDS_NOT_IN_KEY
    assert keyed == set(EngineOptions.model_fields)
    assert keyed <= set(EngineIdentity.model_fields)
    assert {"changes", "calibration"} == PLAN_FIELDS_NOT_IN_KEY


def _facts_platform() -> tuple[PlatformFacts, Platform]:
    return PlatformFacts(None, 0, False), Platform(machine="x86_64", onnxruntime_version="1.31.1")


def test_a_new_engine_option_changes_the_key() -> None:
    """An option added to EngineOptions reaches the key with no edit to key.py."""

    class WiderOptions(EngineOptions):
        tactic_sources: str = "all"

    class WiderPlan(WiderOptions, BuildPlan):
        pass

    class WiderIdentity(WiderOptions, EngineIdentity):
        pass

    facts, platform = _facts_platform()
    plan = plan_build(spec(device="cpu", precision="fp32"), facts, model_static=True)
    keys = {
        engine_cache_key(
            WiderIdentity.for_build(
                model_sha256=SHA_A,
                plan=WiderPlan(**plan.model_dump(), tactic_sources=sources),
                platform=platform,
            )
        )
        for sources in ("all", "cublas")
    }
    assert len(keys) == 2


def test_a_plan_field_outside_the_key_is_refused_by_name() -> None:
    """A field a plan grows without making it an engine option would let two engines share a key."""

    class PlanWithStray(BuildPlan):
        tactic_sources: str = "all"

    facts, platform = _facts_platform()
    plan = plan_build(spec(device="cpu", precision="fp32"), facts, model_static=True)
    stray = PlanWithStray(**plan.model_dump())
    with pytest.raises(BuildError, match=r"\['tactic_sources'\] are not part of the engine key"):
        EngineIdentity.for_build(model_sha256=SHA_A, plan=stray, platform=platform)


# --------------------------------------------------------------------------- model hash


def _model(weights: np.ndarray) -> onnx.ModelProto:
    w = numpy_helper.from_array(weights, name="w")
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 256])],
        [w],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _save_external(model: onnx.ModelProto, path: Path) -> None:
    onnx.save_model(
        model, str(path), save_as_external_data=True, location=f"{path.stem}.data", size_threshold=0
    )


def test_self_contained_model_hash_is_file_hash(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    onnx.save_model(_model(np.ones((1, 256), np.float32)), str(path))
    assert external_data_files(path) == []
    assert model_sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()


def test_external_data_is_part_of_the_model_hash(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    _save_external(_model(np.ones((1, 256), np.float32)), path)
    assert external_data_files(path) == ["m.data"]
    before = model_sha256(path)
    graph_bytes = path.read_bytes()
    assert before != hashlib.sha256(graph_bytes).hexdigest()

    # Same graph file, different weights in the data file: the hash must change.
    data = bytearray((tmp_path / "m.data").read_bytes())
    data[0] ^= 0xFF
    (tmp_path / "m.data").write_bytes(bytes(data))
    assert path.read_bytes() == graph_bytes
    assert model_sha256(path) != before


def test_missing_external_data_is_a_build_error(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    _save_external(_model(np.ones((1, 256), np.float32)), path)
    (tmp_path / "m.data").unlink()
    with pytest.raises(BuildError, match="missing"):
        model_sha256(path)


def test_external_data_outside_the_model_dir_refused(tmp_path: Path) -> None:
    model = _model(np.ones((1, 256), np.float32))
    tensor = model.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value="../../etc/passwd")
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(BuildError, match="next to the model"):
        model_sha256(path)


def test_unreadable_model_is_a_build_error(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    path.write_bytes(b"\xff\x00not a protobuf")
    with pytest.raises(BuildError, match="cannot read ONNX model"):
        model_sha256(path)


def test_calibration_sha256() -> None:
    assert (
        calibration_sha256(b"TRT-100300-EntropyCalibration2\n")
        == hashlib.sha256(b"TRT-100300-EntropyCalibration2\n").hexdigest()
    )


# --------------------------------------------------------------------------- sidecar


def _written(tmp_path: Path) -> tuple[Path, EngineMeta]:
    directory = tmp_path / engine_cache_key(identity())
    directory.mkdir()
    engine = directory / "engine"
    engine.write_bytes(b"serialized plan")
    meta = new_engine_meta(identity(), engine_path=engine, build_seconds=12.5, extra={"layers_on_dla": 41})
    write_sidecar(directory, meta)
    return directory, meta


def test_sidecar_round_trip(tmp_path: Path) -> None:
    directory, meta = _written(tmp_path)
    assert meta.engine_sha256 == hashlib.sha256(b"serialized plan").hexdigest()
    assert meta.engine_bytes == len(b"serialized plan")
    assert read_sidecar(directory) == meta
    assert read_sidecar(directory, expected_key=meta.key) == meta
    assert [p.name for p in directory.iterdir() if p.name.startswith(".")] == []  # no temp files left


def test_sidecar_with_plan(tmp_path: Path) -> None:
    plan = plan_build(spec(device="dla1"), PlatformFacts("10.3.0", 1, True), model_static=True)
    meta = new_engine_meta(identity(), plan=plan)
    write_sidecar(tmp_path, meta)
    read = read_sidecar(tmp_path)
    assert read is not None
    assert read.plan == plan
    assert read.plan.changes[0].effective == "gpu"


def test_missing_sidecar_is_none(tmp_path: Path) -> None:
    assert read_sidecar(tmp_path) is None
    assert read_sidecar(tmp_path / "absent") is None


@pytest.mark.parametrize(
    "corrupt",
    [
        b"",
        b"{",
        b"\xff\xfe garbage",
        b"[]",
        b'{"key": "x"}',
    ],
    ids=["empty", "truncated", "binary", "wrong-type", "incomplete"],
)
def test_unreadable_sidecar_is_none(tmp_path: Path, corrupt: bytes) -> None:
    (tmp_path / SIDECAR_NAME).write_bytes(corrupt)
    assert read_sidecar(tmp_path) is None


def _rewrite(path: Path, edit: Any) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d["identity"].update(backend_version="10.4.0"),  # identity no longer matches its key
        lambda d: d.update(key="f" * 64),
        lambda d: d["identity"].update(key_schema=KEY_SCHEMA + 1),
        lambda d: d.update(unknown_field=1),
    ],
    ids=["identity-edited", "key-edited", "other-schema", "unknown-field"],
)
def test_mismatched_sidecar_is_none(tmp_path: Path, edit: Any) -> None:
    directory, _ = _written(tmp_path)
    _rewrite(directory / SIDECAR_NAME, edit)
    assert read_sidecar(directory) is None


def test_sidecar_for_another_key_is_none(tmp_path: Path) -> None:
    directory, _ = _written(tmp_path)
    assert read_sidecar(directory, expected_key="0" * 64) is None


def test_sidecar_unreadable_file_is_none(tmp_path: Path) -> None:
    (tmp_path / SIDECAR_NAME).mkdir()  # a directory where the file should be: read fails with OSError
    assert read_sidecar(tmp_path) is None


def test_write_sidecar_refuses_inconsistent_meta(tmp_path: Path) -> None:
    meta = new_engine_meta(identity()).model_copy(update={"key": "0" * 64})
    with pytest.raises(BuildError, match="does not match"):
        write_sidecar(tmp_path, meta)
    assert not (tmp_path / SIDECAR_NAME).exists()


def test_rewrite_replaces_sidecar(tmp_path: Path) -> None:
    directory, meta = _written(tmp_path)
    newer = meta.model_copy(update={"build_seconds": 3.0})
    write_sidecar(directory, newer)
    assert read_sidecar(directory) == newer
