"""The pure decisions of a TensorRT build: what to ask TensorRT for, given a :class:`BuildPlan`.

Network flags, memory pools, builder flags, the optimisation profile, the checks a plan must pass,
and the wording of parser errors: every choice the build steps (:mod:`agent.engines.trt.steps`)
make, as plain functions unit-tested without TensorRT.

The API used works from TensorRT 8.5 (JetPack 5) to 10.x (JetPack 6). TensorRT 11 removed
``EXPLICIT_BATCH``, ``BuilderFlag.FP16/INT8`` and the INT8 calibrators: precision then comes from
the ONNX types (Q/DQ), which :func:`builder_flags` and :func:`plan_problems` account for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.engines.job import MIB
from agent.errors import BuildError
from agent.specs.build import BuildPlan, ShapeProfile


def network_flags(trt_major_version: int, explicit_batch_bit: int = 0) -> int:
    """``create_network`` flags: ``1 << EXPLICIT_BATCH`` below TensorRT 10, else 0.

    Explicit batch is the only mode since 10 (the flag is deprecated there and gone in 11).
    ``explicit_batch_bit`` is ``int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)`` (0 in every
    release that has it).
    """
    return 1 << explicit_batch_bit if trt_major_version < 10 else 0


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def pool_limits(plan: BuildPlan) -> list[tuple[str, int]]:
    """``(MemoryPoolType member name, bytes)`` to set: the workspace, plus DLA pools on DLA."""
    limits = [("WORKSPACE", plan.workspace_mb * MIB)]
    if plan.device == "dla":
        for name, mb in (
            ("DLA_MANAGED_SRAM", plan.dla_sram_mb),
            ("DLA_LOCAL_DRAM", plan.dla_local_dram_mb),
            ("DLA_GLOBAL_DRAM", plan.dla_global_dram_mb),
        ):
            if mb is not None:
                limits.append((name, mb * MIB))
    return limits


def builder_flags(plan: BuildPlan, trt_major_version: int) -> list[str]:
    """``BuilderFlag`` member names to set for ``plan``.

    DLA runs only FP16 or INT8 and INT8 on DLA needs FP16 too (for the layers it cannot quantise).
    Q/DQ models also need the INT8 flag before TensorRT 11; from 11 on, precision comes from the
    ONNX types and the FP16/INT8 flags no longer exist.
    """
    flags: list[str] = []
    if trt_major_version < 11:
        if plan.precision == "fp16":
            flags.append("FP16")
        elif plan.precision == "int8":
            flags.append("INT8")
            if plan.device == "dla":
                flags.append("FP16")
    if plan.device == "dla" and plan.gpu_fallback:
        flags.append("GPU_FALLBACK")
    return flags


def plan_problems(plan: BuildPlan, trt_major_version: int, num_dla_cores: int | None = None) -> list[str]:
    """Every reason this plan cannot be built by this TensorRT (empty when it can).

    The planner should never produce these; this is the last check before TensorRT reports the
    same mistakes far less clearly (or silently builds something else).
    """
    problems: list[str] = []
    if plan.backend != "tensorrt":
        problems.append(f"plan is for backend {plan.backend!r}, not tensorrt")
    if plan.device == "cpu":
        problems.append("TensorRT cannot build for the CPU; plan the onnxruntime backend instead")
    if plan.device == "dla":
        if plan.dla_core is None:
            problems.append("device dla needs a dla_core")
        elif num_dla_cores is not None and plan.dla_core >= num_dla_cores:
            problems.append(
                f"DLA core {plan.dla_core} requested but this device has {num_dla_cores} DLA core(s)"
            )
        if plan.precision == "fp32":
            problems.append("DLA runs only fp16 or int8; plan fp16 or int8 for device dla")
        dynamic = [p.input for p in plan.profiles if not p.is_static]
        if dynamic:
            problems.append(f"DLA needs static shapes (min = opt = max); dynamic profiles for {dynamic}")
        for name, mb in (
            ("dla_sram_mb", plan.dla_sram_mb),
            ("dla_local_dram_mb", plan.dla_local_dram_mb),
            ("dla_global_dram_mb", plan.dla_global_dram_mb),
        ):
            if mb is not None and not _is_power_of_two(mb):
                problems.append(f"{name} must be a power of two (DLA memory pools), got {mb}")
    if plan.precision == "int8" and plan.int8_mode == "none":
        problems.append("int8 precision needs int8_mode 'calibrator' or 'qdq'")
    if plan.int8_mode == "calibrator" and trt_major_version >= 11:
        problems.append("TensorRT 11 removed INT8 calibrators; quantise the model to Q/DQ (int8_mode 'qdq')")
    if plan.precision != "int8" and plan.int8_mode != "none":
        problems.append(f"int8_mode {plan.int8_mode!r} with precision {plan.precision!r}")
    return problems


@dataclass(frozen=True)
class ProfileShape:
    """One input's min/opt/max for the optimisation profile."""

    input: str
    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]


def profile_shapes(
    profiles: Sequence[ShapeProfile], network_inputs: Sequence[tuple[str, Sequence[int]]]
) -> list[ProfileShape]:
    """The optimisation profile for the network's dynamic inputs (empty when all are static).

    ``network_inputs`` are ``(name, dims)`` with ``-1`` for dynamic axes. An input with a
    profile in the plan uses it (checked against the network's fixed axes); a dynamic input
    without one is pinned to batch 1 when only its batch axis is dynamic, and is an error
    otherwise, because guessing an image size would build an engine nobody asked for.
    """
    by_name = {p.input: p for p in profiles}
    names = {name for name, _ in network_inputs}
    unknown = sorted(set(by_name) - names)
    if unknown:
        raise BuildError(
            f"shape profiles name inputs the model does not have: {unknown}; inputs: {sorted(names)}"
        )
    shapes: list[ProfileShape] = []
    for name, raw_dims in network_inputs:
        dims = tuple(int(d) for d in raw_dims)
        dynamic_axes = [axis for axis, d in enumerate(dims) if d < 0]
        profile = by_name.get(name)
        if profile is not None:
            if len(profile.min) != len(dims):
                raise BuildError(
                    f"profile for {name!r} has rank {len(profile.min)}, the model input has rank {len(dims)}"
                )
            for axis, d in enumerate(dims):
                if d >= 0 and not (profile.min[axis] == profile.opt[axis] == profile.max[axis] == d):
                    raise BuildError(
                        f"profile for {name!r} changes axis {axis}, which the model fixes at {d}"
                    )
            shapes.append(ProfileShape(name, profile.min, profile.opt, profile.max))
        elif dynamic_axes == [0]:
            pinned = (1, *dims[1:])
            shapes.append(ProfileShape(name, pinned, pinned, pinned))
        elif dynamic_axes:
            raise BuildError(
                f"input {name!r} has dynamic axes {dynamic_axes} {dims}; "
                "add a shape profile for it to the build spec"
            )
    # A profile is only needed (and only allowed to be empty) when something is dynamic.
    return shapes if any(any(d < 0 for d in dims) for _, dims in network_inputs) else []


def format_parser_errors(errors: Sequence[str], onnx_path: Path) -> str:
    """One BuildError message listing every ONNX parser error."""
    if not errors:
        return f"TensorRT could not parse {onnx_path.name} (no parser error reported)"
    lines = "\n".join(f"  {i + 1}. {e}" for i, e in enumerate(errors))
    return f"TensorRT could not parse {onnx_path.name} ({len(errors)} error(s)):\n{lines}"


def calibration_batch_size(
    shapes: Sequence[ProfileShape], network_inputs: Sequence[tuple[str, Sequence[int]]]
) -> int:
    """Batch size the INT8 calibrator feeds: the profile's opt batch, else the largest fixed batch (>= 1)."""
    if shapes:
        return shapes[0].opt[0]
    return max((int(dims[0]) if dims and int(dims[0]) > 0 else 1 for _, dims in network_inputs), default=1)


def calibration_problem(plan: BuildPlan, *, has_batches: bool, cache_exists: bool) -> str | None:
    """Why the INT8 calibrator cannot run for ``plan`` (None when it can, or is not needed)."""
    if plan.int8_mode != "calibrator" or has_batches or cache_exists:
        return None
    return "INT8 calibration needs calibration frames or an existing calibration cache"


def target_label(plan: BuildPlan) -> str:
    """``gpu fp16``, ``dla0 int8``: what a build targets, for progress lines."""
    core = "" if plan.dla_core is None else str(plan.dla_core)
    return f"{plan.device}{core} {plan.precision}"


def warning_lines(log_text: str, keep: int = 50) -> list[str]:
    """The last ``keep`` warnings of a build log as :class:`~agent.engines.trt.log.BuildLog` writes it."""
    return [line for line in log_text.splitlines() if line.startswith("[W]")][-keep:]
