"""The TensorRT build as a row of small named steps, composed the way Polygraphy's loaders are.

``EngineBytesFromNetwork(NetworkFromOnnxPath(...), CreateConfig(...))()`` parses the model, configures
the builder and serializes the engine; :class:`PlacementFromBuild` then reports where its layers run.
Each step is a callable object holding its options: a step that needs the result of another takes
that step (any callable) and calls it, so a test or a tool can swap one step (a network made in
code, a config with an extra flag) without touching the others. Every decision a step makes is a
pure function of :mod:`agent.engines.trt.decisions`; the steps only call TensorRT (imported lazily:
this module imports without it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from agent.backends.trt_api import dims_of, nullable, succeeded, trt_major
from agent.engines.job import Progress
from agent.engines.trt.calibrator import CalibrationBatch, Calibrator, make_entropy_calibrator
from agent.engines.trt.decisions import (
    ProfileShape,
    builder_flags,
    calibration_batch_size,
    calibration_problem,
    format_parser_errors,
    network_flags,
    plan_problems,
    pool_limits,
    profile_shapes,
)
from agent.engines.trt.log import BuildLog
from agent.engines.trt.placement import (
    Placement,
    combine_placement,
    parse_inspector_json,
    parse_placement_log,
)
from agent.errors import BuildError, EngineError
from agent.fsutil import atomic_write_bytes
from agent.specs.build import BuildPlan

if TYPE_CHECKING:
    import tensorrt as trt

events = structlog.get_logger(__name__)


@dataclass(frozen=True)
class ParsedNetwork:
    """A network parsed from ONNX, with the builder that made it and the parser that filled it.

    The parser is kept alive with the network: the network refers to weights the parser owns.
    """

    builder: trt.Builder
    network: trt.INetworkDefinition
    parser: trt.OnnxParser

    def input_dims(self) -> list[tuple[str, list[int]]]:
        """``(name, dims)`` of every network input, ``-1`` for a dynamic axis."""
        inputs = (self.network.get_input(i) for i in range(self.network.num_inputs))
        return [(tensor.name, dims_of(tensor.shape)) for tensor in inputs]


@dataclass(frozen=True)
class NetworkFromOnnxPath:
    """Step 1: create the builder, check the plan against this TensorRT and device, parse the file."""

    path: Path
    plan: BuildPlan
    logger: trt.ILogger
    say: Progress

    def __call__(self) -> ParsedNetwork:
        """The parsed network; BuildError listing every plan problem or parser error."""
        import tensorrt as trt

        major = trt_major(trt.__version__)
        builder = trt.Builder(self.logger)
        dla_cores = builder.num_DLA_cores if self.plan.device == "dla" else None
        problems = plan_problems(self.plan, major, dla_cores)
        if problems:
            raise BuildError(
                f"cannot build this plan with TensorRT {trt.__version__}: " + "; ".join(problems)
            )
        explicit_bit = int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH) if major < 10 else 0
        network = builder.create_network(network_flags(major, explicit_bit))
        parser = trt.OnnxParser(network, self.logger)
        self.say(f"parsing {self.path.name}")
        # parse_from_file (not parse(bytes)) so external-data weights next to the model are found.
        if not succeeded(parser.parse_from_file(str(self.path))):
            errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
            raise BuildError(format_parser_errors(errors, self.path))
        return ParsedNetwork(builder, network, parser)


@dataclass(frozen=True)
class BuilderConfig:
    """A configured ``IBuilderConfig`` and the INT8 calibrator it holds (release it after the build)."""

    config: trt.IBuilderConfig
    calibrator: Calibrator | None = None


@dataclass(frozen=True)
class CreateConfig:
    """Step 2: the builder config for the plan: memory pools, flags, DLA core, optimisation level,
    shape profile, timing cache and, for ``int8_mode == 'calibrator'``, the entropy calibrator."""

    plan: BuildPlan
    timing_cache: Path | None = None
    calibration_cache: Path | None = None
    calib_batches: Iterable[CalibrationBatch] | None = None

    def __call__(self, net: ParsedNetwork) -> BuilderConfig:
        """Configure a new builder config of ``net``'s builder; BuildError when TensorRT refuses."""
        import tensorrt as trt

        plan = self.plan
        config = net.builder.create_builder_config()
        for pool_name, nbytes in pool_limits(plan):
            config.set_memory_pool_limit(getattr(trt.MemoryPoolType, pool_name), nbytes)
        for flag_name in builder_flags(plan, trt_major(trt.__version__)):
            config.set_flag(getattr(trt.BuilderFlag, flag_name))
        if plan.device == "dla":
            assert plan.dla_core is not None  # plan_problems checked it
            config.default_device_type = trt.DeviceType.DLA
            config.DLA_core = plan.dla_core
        if hasattr(config, "builder_optimization_level"):  # 8.6+
            config.builder_optimization_level = plan.optimization_level
        config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
        inputs = net.input_dims()
        shapes = profile_shapes(plan.profiles, inputs)
        profile = _add_profile(net.builder, config, shapes)
        if self.timing_cache is not None:
            _load_timing_cache(config, self.timing_cache)
        calibrator = self._calibrator(calibration_batch_size(shapes, inputs))
        if calibrator is not None:
            config.int8_calibrator = calibrator.trt_calibrator
            if profile is not None:
                config.set_calibration_profile(profile)
        return BuilderConfig(config, calibrator)

    def _calibrator(self, batch_size: int) -> Calibrator | None:
        cache = self.calibration_cache
        problem = calibration_problem(
            self.plan,
            has_batches=self.calib_batches is not None,
            cache_exists=cache is not None and cache.exists(),
        )
        if problem is not None:
            raise BuildError(problem)
        if self.plan.int8_mode != "calibrator":
            return None
        batches = self.calib_batches if self.calib_batches is not None else ()
        return make_entropy_calibrator(batches, batch_size=batch_size, cache_path=cache)


def _add_profile(
    builder: trt.Builder, config: trt.IBuilderConfig, shapes: list[ProfileShape]
) -> trt.IOptimizationProfile | None:
    """The optimisation profile for the dynamic inputs, added to ``config`` (None when all are static)."""
    if not shapes:
        return None
    import tensorrt as trt

    profile = builder.create_optimization_profile()
    for shape in shapes:
        profile.set_shape(
            shape.input, trt.Dims(list(shape.min)), trt.Dims(list(shape.opt)), trt.Dims(list(shape.max))
        )
    if config.add_optimization_profile(profile) < 0:
        raise BuildError(f"TensorRT rejected the optimisation profile {shapes}")
    return profile


def _load_timing_cache(config: trt.IBuilderConfig, path: Path) -> None:
    cache = config.create_timing_cache(_read_timing_cache(path))
    if not succeeded(config.set_timing_cache(cache, ignore_mismatch=False)):
        # A cache from another device or TensorRT: start a fresh one rather than mix tactics.
        events.warning("engine.build.timing_cache_mismatch", path=str(path))
        config.set_timing_cache(config.create_timing_cache(b""), ignore_mismatch=False)


def _read_timing_cache(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return b""
    except OSError as exc:
        events.warning("engine.build.timing_cache_unreadable", path=str(path), error=str(exc))
        return b""


@dataclass(frozen=True)
class EngineBytesFromNetwork:
    """Step 3: build and serialize the engine from the network and config the steps before make.

    ``save_timing_cache`` rewrites the device's timing cache after a successful build (a failure to
    write it is logged: the engine is good without it).
    """

    network: Callable[[], ParsedNetwork]
    config: Callable[[ParsedNetwork], BuilderConfig]
    build_log: BuildLog
    say: Progress
    target: str = ""
    save_timing_cache: Path | None = None

    def __call__(self) -> bytes:
        """The serialized engine; BuildError with the calibrator's error or TensorRT's last log lines."""
        net = self.network()
        built = self.config(net)
        self.say(f"building for {self.target}" if self.target else "building")
        try:
            serialized = nullable(net.builder.build_serialized_network(net.network, built.config))
        finally:
            if built.calibrator is not None:
                built.calibrator.release()
        if built.calibrator is not None and built.calibrator.feed.error is not None:
            raise built.calibrator.feed.error
        if serialized is None:
            raise BuildError(f"TensorRT could not build the engine; last log lines:\n{self.build_log.tail()}")
        if self.save_timing_cache is not None:
            _save_timing_cache(built.config, self.save_timing_cache)
        return bytes(memoryview(serialized))


def _save_timing_cache(config: trt.IBuilderConfig, path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, bytes(memoryview(config.get_timing_cache().serialize())))
    except OSError as exc:
        events.warning("engine.build.timing_cache_write_failed", path=str(path), error=str(exc))


@dataclass(frozen=True)
class PlacementFromBuild:
    """Step 4: where the engine's layers run, from the build log's block and the engine inspector."""

    build_log: BuildLog
    logger: trt.ILogger
    dla_core: int | None = None

    def __call__(self, plan_bytes: bytes) -> Placement:
        """The combined placement (counts from the log when it has them, layers from the inspector)."""
        return combine_placement(
            parse_placement_log(self.build_log.placement_text()), self._inspect(plan_bytes)
        )

    def _inspect(self, plan_bytes: bytes) -> Placement | None:
        """Placement from the engine inspector; None when the engine cannot be deserialized here."""
        import tensorrt as trt

        try:
            runtime = trt.Runtime(self.logger)
            if self.dla_core is not None:
                runtime.DLA_core = self.dla_core  # before deserializing (onnxruntime#26680)
            engine = nullable(runtime.deserialize_cuda_engine(plan_bytes))
            if engine is None:
                return None
            inspector = engine.create_engine_inspector()
            text = inspector.get_engine_information(trt.LayerInformationFormat.JSON)
            return parse_inspector_json(str(text), dla_requested=self.dla_core is not None)
        except (RuntimeError, AttributeError, TypeError, EngineError) as exc:
            events.warning("engine.build.inspect_failed", error=str(exc))
            return None
