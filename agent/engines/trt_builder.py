"""Build a TensorRT engine (serialized plan) from an ONNX model according to a :class:`BuildPlan`.

The imperative shell, :func:`build_engine`, only calls TensorRT; every decision and every parsing
step is a pure function below it (network flags, memory pools, builder flags, shape profiles, plan
checks, the build-log placement block, the engine-inspector JSON), unit-tested without TensorRT.

The API used works from TensorRT 8.5 (JetPack 5) to 10.x (JetPack 6). TensorRT 11 removed
``EXPLICIT_BATCH``, ``BuilderFlag.FP16/INT8`` and the INT8 calibrators: precision then comes from
the ONNX types (Q/DQ), which :func:`builder_flags` and :func:`plan_problems` account for.

Where the layers run is reported, never assumed: DLA's GPU fallback is silent, so the build log's
"Layers Running on DLA / on GPU" block (captured by a custom logger) and the engine inspector's JSON
are parsed into a :class:`Placement`.
"""

from __future__ import annotations

import json
import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import structlog

from agent.backends.tensorrt import dims_of, nullable, succeeded, tensorrt_status, trt_major
from agent.engines.spec import BuildPlan, ShapeProfile
from agent.engines.trt_calibrator import CalibrationBatch, Calibrator, make_entropy_calibrator
from agent.errors import BuildError, EngineError
from agent.fsutil import atomic_write_bytes

if TYPE_CHECKING:
    import tensorrt as trt

events = structlog.get_logger(__name__)

MIB = 1 << 20

#: Placement of one layer: on a DLA core, on the GPU, or neither (DLA <-> GPU transfer nodes).
Device = Literal["dla", "gpu", "other"]

# ---------------------------------------------------------------------------------------------
# Pure decisions
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Placement: build-log block and engine-inspector JSON
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerPlacement:
    """Where one (possibly fused) layer runs."""

    name: str
    device: Device
    kind: str = ""


@dataclass(frozen=True)
class Placement:
    """Layers on DLA vs GPU, as TensorRT reported them (``source`` says where from)."""

    dla_layers: int = 0
    gpu_layers: int = 0
    layers: tuple[LayerPlacement, ...] = ()
    source: str = "none"

    def as_dict(self) -> dict[str, Any]:
        return {
            "dla_layers": self.dla_layers,
            "gpu_layers": self.gpu_layers,
            "layers": [{"name": lp.name, "device": lp.device, "kind": lp.kind} for lp in self.layers],
            "source": self.source,
        }


# TensorRT 8.x-10.x: "---------- Layers Running on DLA ----------"; 7.x and some samples:
# "--------------- Layers running on DLA:".
_HEADER = re.compile(r"Layers\s+[Rr]unning\s+on\s+(DLA|GPU)\b")
_TAGGED = re.compile(r"\[(Dla|Gpu)Layer\]\s*(.*)$")
_NO_LAYER = re.compile(r"No layer is running on (DLA|GPU)", re.IGNORECASE)
# Prefixes that trtexec, TensorRT's own loggers and DeepStream put before a message.
_PREFIX = re.compile(
    r"^(?:\s*(?:\[\d{2}/\d{2}/\d{4}-\d{2}:\d{2}:\d{2}\]|\[[IVWEF]\]|\[TRT\]:?|\[TensorRT\]|"
    r"(?:INTERNAL_ERROR|ERROR|WARNING|INFO|VERBOSE):))+\s*"
)
_GPU_KIND = re.compile(r"^([A-Z][A-Z0-9_]*):\s+(.*)$")


def _strip_prefix(line: str) -> str:
    return _PREFIX.sub("", line).strip()


def _split_top_level(text: str) -> list[str]:
    """Split a comma list, ignoring commas inside (), [] and {} (fused names contain them)."""
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth = max(depth - 1, 0)
        if ch == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
    parts.append("".join(current).strip())
    return [p for p in parts if p]


def _entry(device: Device, text: str) -> LayerPlacement:
    text = text.strip().rstrip(",").strip()
    if device == "gpu":
        m = _GPU_KIND.match(text)
        if m:
            return LayerPlacement(m.group(2).strip(), "gpu", m.group(1))
        return LayerPlacement(text, "gpu")
    kind = "ForeignNode" if text.startswith("{ForeignNode[") else ""
    return LayerPlacement(text, "dla", kind)


def parse_placement_log(text: str) -> Placement | None:
    """Parse the "Layers Running on DLA / on GPU" block of a TensorRT build log.

    Understands the 8.x-10.x form (``[DlaLayer] {ForeignNode[...]}`` / ``[GpuLayer] TYPE: name``
    lines under dashed headers) and the 7.x form (one comma-separated line per header), with or
    without trtexec/TensorRT logger prefixes. Each DLA entry is one DLA subgraph (loadable);
    each GPU entry one GPU layer. Returns None when the log has no such block (GPU-only builds).
    """
    section: Device | None = None
    freeform_used = False
    seen = False
    layers: list[LayerPlacement] = []
    for raw in text.splitlines():
        line = _strip_prefix(raw)
        header = _HEADER.search(line)
        if header:
            section = "dla" if header.group(1) == "DLA" else "gpu"
            seen, freeform_used = True, False
            continue
        if section is None:
            continue
        tagged = _TAGGED.search(line)
        if tagged:
            tag_device: Device = "dla" if tagged.group(1) == "Dla" else "gpu"
            layers.append(_entry(tag_device, tagged.group(2)))
            freeform_used = True
            continue
        if _NO_LAYER.search(line):
            freeform_used = True
            continue
        if line and not freeform_used:
            # 7.x: the whole section on one line, "{a,b}, {c}" for DLA, "x, y" for GPU.
            items = re.findall(r"\{[^{}]*\}", line) if section == "dla" else _split_top_level(line)
            layers.extend(_entry(section, item) for item in items)
            freeform_used = True
            continue
        section = None
    if not seen:
        return None
    return Placement(
        dla_layers=sum(1 for lp in layers if lp.device == "dla"),
        gpu_layers=sum(1 for lp in layers if lp.device == "gpu"),
        layers=tuple(layers),
        source="log",
    )


def classify_inspector_layer(name: str, kind: str, dla_requested: bool) -> Device:
    """Device of one engine-inspector layer (a heuristic; the build-log block is authoritative).

    A ``LayerType`` naming DLA is DLA. DLA subgraphs are otherwise recognisable only as
    ``{ForeignNode[...]}`` layers, a name GPU Myelin regions share, so a foreign node counts as
    DLA only when DLA was requested and its type is not Myelin. The ``... to nvm`` / ``... from
    nvm`` / ``... copy finish`` nodes move data between GPU and DLA memory: ``other``.
    """
    lowered_kind = kind.lower()
    lowered_name = name.lower()
    if "dla" in lowered_kind:
        return "dla"
    if lowered_name.endswith((" to nvm", " from nvm", " copy finish")):
        return "other"
    if name.startswith("{ForeignNode[") and dla_requested and "myelin" not in lowered_kind:
        return "dla"
    return "gpu"


def parse_inspector_json(text: str, *, dla_requested: bool) -> Placement | None:
    """Parse ``EngineInspector.get_engine_information(LayerInformationFormat.JSON)``.

    With ``ProfilingVerbosity.DETAILED`` each layer is an object with ``Name`` and ``LayerType``;
    with ``LAYER_NAMES_ONLY`` (the default) each is a bare name string. Returns None when the text
    is not that JSON.
    """
    try:
        data = json.loads(text)
    except ValueError:
        return None
    raw_layers = data.get("Layers") if isinstance(data, dict) else None
    if not isinstance(raw_layers, list):
        return None
    layers: list[LayerPlacement] = []
    for item in raw_layers:
        if isinstance(item, str):
            name, kind = item, ""
        elif isinstance(item, dict):
            name = str(item.get("Name", ""))
            kind = str(item.get("LayerType") or item.get("ParameterType") or "")
        else:
            continue
        # TensorRT 8.6+/10 separate metadata with ASCII unit/record separators.
        name = name.replace("\x1e", "+").replace("\x1f", "+")
        layers.append(LayerPlacement(name, classify_inspector_layer(name, kind, dla_requested), kind))
    return Placement(
        dla_layers=sum(1 for lp in layers if lp.device == "dla"),
        gpu_layers=sum(1 for lp in layers if lp.device == "gpu"),
        layers=tuple(layers),
        source="inspector",
    )


def combine_placement(from_log: Placement | None, from_inspector: Placement | None) -> Placement:
    """Counts from the build log when it has the block (authoritative for DLA), else from the
    inspector; the layer list from the inspector when present (it lists the final engine layers)."""
    if from_log is not None and from_inspector is not None:
        return Placement(
            dla_layers=from_log.dla_layers,
            gpu_layers=from_log.gpu_layers,
            layers=from_inspector.layers,
            source="log+inspector",
        )
    if from_log is not None:
        return from_log
    if from_inspector is not None:
        return from_inspector
    return Placement()


# ---------------------------------------------------------------------------------------------
# Build log capture
# ---------------------------------------------------------------------------------------------

_SEVERITY_TAG = {"INTERNAL_ERROR": "F", "ERROR": "E", "WARNING": "W", "INFO": "I", "VERBOSE": "V"}


class BuildLog:
    """What TensorRT said during a build, bounded in memory.

    Keeps the last ``max_lines`` INFO-or-worse messages (verbose builds emit hundreds of
    thousands), and every line of the placement block whatever its severity (TensorRT 10 logs it
    at VERBOSE, 8.x at INFO). Errors are forwarded to ``sink`` as they happen.
    """

    def __init__(self, max_lines: int = 2000, sink: Callable[[str], None] | None = None) -> None:
        self._lines: deque[str] = deque(maxlen=max_lines)
        self._placement: list[str] = []
        self._after_header = False
        self._sink = sink
        self.errors: list[str] = []

    def add(self, severity: str, message: str) -> None:
        tag = _SEVERITY_TAG.get(severity.upper(), "?")
        line = f"[{tag}] {message}"
        if tag != "V":
            self._lines.append(line)
        if tag in ("F", "E"):
            self.errors.append(message)
            if self._sink is not None:
                self._sink(line)
        self._track_placement(message)

    def _track_placement(self, message: str) -> None:
        if _HEADER.search(message):
            self._placement.append(message)
            self._after_header = True
        elif _TAGGED.search(message) or _NO_LAYER.search(message):
            self._placement.append(message)
            self._after_header = False
        elif self._after_header:
            # The 7.x form puts the section on the line after its header.
            self._placement.append(message)
            self._after_header = False

    def text(self) -> str:
        return "\n".join(self._lines)

    def tail(self, lines: int = 30) -> str:
        return "\n".join(list(self._lines)[-lines:])

    def placement_text(self) -> str:
        return "\n".join(self._placement)


def _capturing_logger(build_log: BuildLog) -> trt.ILogger:
    """A ``trt.ILogger`` that records every message into ``build_log`` (needs TensorRT)."""
    import tensorrt as trt

    class CapturingLogger(trt.ILogger):
        def __init__(self) -> None:
            # pybind11 trampoline: the base __init__ must run or TensorRT cannot call log().
            trt.ILogger.__init__(self)

        def log(self, severity: trt.ILogger.Severity, msg: str) -> None:
            try:
                build_log.add(getattr(severity, "name", str(severity)), msg)
            except Exception:  # noqa: BLE001 - an exception must never propagate into TensorRT's C++
                return

    logger: trt.ILogger = CapturingLogger()
    return logger


# ---------------------------------------------------------------------------------------------
# The imperative shell
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuiltEngine:
    """A serialized engine and what the build reported."""

    plan: bytes
    placement: Placement
    build_log: str
    build_seconds: float
    trt_version: str
    warnings: list[str] = field(default_factory=list)


def _read_timing_cache(path: Path | None) -> bytes:
    if path is None:
        return b""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return b""
    except OSError as exc:
        events.warning("engine.build.timing_cache_unreadable", path=str(path), error=str(exc))
        return b""


def build_engine(
    onnx_path: Path,
    plan: BuildPlan,
    *,
    timing_cache: Path | None,
    calibration_cache: Path | None,
    calib_batches: Iterable[CalibrationBatch] | None,
    log: Callable[[str], None] | None = None,
) -> BuiltEngine:
    """Build a serialized TensorRT engine from ``onnx_path`` as ``plan`` says.

    ``timing_cache`` is read if it exists and rewritten after the build; ``calibration_cache``
    and ``calib_batches`` feed the INT8 entropy calibrator (``int8_mode == 'calibrator'``): with a
    valid cache TensorRT skips calibration. ``log`` receives progress and error lines. Raises
    :class:`BuildError` with the reason (parser errors, the tail of TensorRT's log, ...).
    Run it in a child process: a TensorRT crash must not take the agent down.
    """
    say = log if log is not None else (lambda _line: None)
    ok, why = tensorrt_status()
    if not ok:
        raise BuildError(why)
    import tensorrt as trt

    major = trt_major(trt.__version__)
    started = time.monotonic()
    build_log = BuildLog(sink=say)
    logger = _capturing_logger(build_log)
    builder = trt.Builder(logger)
    problems = plan_problems(plan, major, builder.num_DLA_cores if plan.device == "dla" else None)
    if problems:
        raise BuildError(
            "cannot build this plan with TensorRT " + trt.__version__ + ": " + "; ".join(problems)
        )

    explicit_bit = int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH) if major < 10 else 0
    network = builder.create_network(network_flags(major, explicit_bit))
    parser = trt.OnnxParser(network, logger)
    say(f"parsing {onnx_path.name}")
    # parse_from_file (not parse(bytes)) so external-data weights next to the model are found.
    if not succeeded(parser.parse_from_file(str(onnx_path))):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise BuildError(format_parser_errors(errors, onnx_path))

    config = builder.create_builder_config()
    for pool_name, nbytes in pool_limits(plan):
        config.set_memory_pool_limit(getattr(trt.MemoryPoolType, pool_name), nbytes)
    for flag_name in builder_flags(plan, major):
        config.set_flag(getattr(trt.BuilderFlag, flag_name))
    if plan.device == "dla":
        assert plan.dla_core is not None  # plan_problems checked it
        config.default_device_type = trt.DeviceType.DLA
        config.DLA_core = plan.dla_core
    inputs = [
        (network.get_input(i).name, dims_of(network.get_input(i).shape)) for i in range(network.num_inputs)
    ]
    shapes = profile_shapes(plan.profiles, inputs)
    profile = None
    if shapes:
        profile = builder.create_optimization_profile()
        for shape in shapes:
            profile.set_shape(
                shape.input, trt.Dims(list(shape.min)), trt.Dims(list(shape.opt)), trt.Dims(list(shape.max))
            )
        if config.add_optimization_profile(profile) < 0:
            raise BuildError(f"TensorRT rejected the optimisation profile {shapes}")
    if hasattr(config, "builder_optimization_level"):  # 8.6+
        config.builder_optimization_level = plan.optimization_level
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED

    if timing_cache is not None:
        tc = config.create_timing_cache(_read_timing_cache(timing_cache))
        if not succeeded(config.set_timing_cache(tc, ignore_mismatch=False)):
            # A cache from another device or TensorRT: start a fresh one rather than mix tactics.
            events.warning("engine.build.timing_cache_mismatch", path=str(timing_cache))
            config.set_timing_cache(config.create_timing_cache(b""), ignore_mismatch=False)

    calibrator: Calibrator | None = None
    if plan.int8_mode == "calibrator":
        if calib_batches is None and (calibration_cache is None or not calibration_cache.exists()):
            raise BuildError("INT8 calibration needs calibration frames or an existing calibration cache")
        batch = shapes[0].opt[0] if shapes else max(_first_dim(dims) for _, dims in inputs)
        calibrator = make_entropy_calibrator(
            calib_batches if calib_batches is not None else (), batch_size=batch, cache_path=calibration_cache
        )
        config.int8_calibrator = calibrator.trt_calibrator
        if profile is not None:
            config.set_calibration_profile(profile)

    say(f"building for {plan.device}{'' if plan.dla_core is None else plan.dla_core} {plan.precision}")
    try:
        serialized = nullable(builder.build_serialized_network(network, config))
    finally:
        if calibrator is not None:
            calibrator.release()
    if calibrator is not None and calibrator.feed.error is not None:
        raise calibrator.feed.error
    if serialized is None:
        raise BuildError(f"TensorRT could not build the engine; last log lines:\n{build_log.tail()}")
    plan_bytes = bytes(memoryview(serialized))

    if timing_cache is not None:
        try:
            timing_cache.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(timing_cache, bytes(memoryview(config.get_timing_cache().serialize())))
        except OSError as exc:
            events.warning("engine.build.timing_cache_write_failed", path=str(timing_cache), error=str(exc))

    placement = combine_placement(
        parse_placement_log(build_log.placement_text()),
        _inspect(logger, plan_bytes, plan.dla_core if plan.device == "dla" else None),
    )
    seconds = time.monotonic() - started
    say(f"built in {seconds:.1f}s: {placement.dla_layers} DLA / {placement.gpu_layers} GPU layers")
    return BuiltEngine(
        plan=plan_bytes,
        placement=placement,
        build_log=build_log.text(),
        build_seconds=seconds,
        trt_version=trt.__version__,
        warnings=[line for line in build_log.text().splitlines() if line.startswith("[W]")][-50:],
    )


def _first_dim(dims: Sequence[int]) -> int:
    return int(dims[0]) if dims and int(dims[0]) > 0 else 1


def _inspect(logger: trt.ILogger, plan_bytes: bytes, dla_core: int | None) -> Placement | None:
    """Placement from the engine inspector; None when the engine cannot be deserialized here."""
    import tensorrt as trt

    try:
        runtime = trt.Runtime(logger)
        if dla_core is not None:
            runtime.DLA_core = dla_core  # before deserializing (onnxruntime#26680)
        engine = nullable(runtime.deserialize_cuda_engine(plan_bytes))
        if engine is None:
            return None
        inspector = engine.create_engine_inspector()
        text = inspector.get_engine_information(trt.LayerInformationFormat.JSON)
        return parse_inspector_json(str(text), dla_requested=dla_core is not None)
    except (RuntimeError, AttributeError, TypeError, EngineError) as exc:
        events.warning("engine.build.inspect_failed", error=str(exc))
        return None
