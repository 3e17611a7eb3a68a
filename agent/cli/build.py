"""``edge-agent build MODEL.onnx``: build (or find in the cache) an engine offline, like ``trtexec``.

Prints the plan with a reason for every change, the build time, the cache entry (key, path, hit or
miss), where the layers run (TensorRT placement, or ONNX Runtime's providers), and with ``--bench``
the throughput of the engine on random input, beside every other backend this device has (ONNX
Runtime CPU, CUDA, TensorRT EP, native TensorRT; :mod:`agent.measure.throughput`), each skipped
with its reason when absent. ``--calib DIR`` calibrates INT8 on the images in DIR, preprocessed
to ``--width`` x ``--height`` (default: the model's input size), RGB, pixels / 255;
``--calib-from VIDEO`` first writes ``--calib-frames`` frames of a video file or stream into that
directory (:mod:`agent.engines.calibration.video`).

The cache is the agent's own (``--state-dir``, or ``state_dir`` from ``--config``), so an engine
built here ahead of a deploy is a cache hit for the daemon on the same device.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from agent.errors import AgentError, BuildError, UsageError
from agent.flag_aliases import add_alias

# Only argparse is needed to declare the options; the builder (onnx, numpy, ...) loads when the
# command runs, so `edge-agent --help` and the other commands stay fast.
if TYPE_CHECKING:
    from collections.abc import Callable

    from agent.engines.building.artifact import EngineArtifact
    from agent.engines.building.builder import EngineBuilder
    from agent.engines.settings import EngineConfig
    from agent.measure.throughput import ComparisonRow
    from agent.specs.build import BuildSpec
    from agent.specs.preprocess import PreprocessSpec

DEFAULT_ITERATIONS = 200


def default_state_dir() -> Path:
    """``$XDG_CACHE_HOME/edge-agent`` (``~/.cache/edge-agent``) when no state dir is given."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "edge-agent"


def add_build_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``edge-agent build``."""
    parser.add_argument("model", type=Path, help="ONNX model to build")
    parser.add_argument(
        "--precision", choices=("fp32", "fp16", "int8", "best"), default="fp16", help="engine precision"
    )
    engine_device = parser.add_argument(
        "--engine-device",
        choices=("auto", "gpu", "dla0", "dla1", "cpu"),
        default="auto",
        help="where the engine runs (dla0/dla1: a Jetson's DLA cores)",
    )
    add_alias(parser, "--device", engine_device)  # its name before docs/cli.md's one scheme
    parser.add_argument(
        "--no-gpu-fallback", action="store_true", help="fail DLA layers instead of using the GPU"
    )
    parser.add_argument("--workspace-mb", type=int, default=1024, help="TensorRT workspace limit (MB)")
    parser.add_argument(
        "--opt-level", type=int, default=3, choices=range(6), metavar="0-5", help="builder optimization level"
    )
    parser.add_argument("--calib", type=Path, metavar="DIR", help="directory of images to calibrate INT8 on")
    parser.add_argument(
        "--calib-from",
        metavar="VIDEO",
        help="make the --calib DIR first: --calib-frames frames spread over this video file or stream "
        "URL (default DIR: ./calib-<video name>)",
    )
    parser.add_argument(
        "--calib-cache",
        type=Path,
        metavar="FILE",
        help="calibration to quantize with, no calibration run: a calibration table (calibration.json of an "
        "INT8 build) or a TensorRT calibration cache",
    )
    parser.add_argument("--calib-frames", type=int, default=200, help="images to calibrate on (default 200)")
    parser.add_argument("--width", type=int, help="calibration input width (default: the model's)")
    parser.add_argument("--height", type=int, help="calibration input height (default: the model's)")
    parser.add_argument(
        "--bench",
        action="store_true",
        help="measure throughput on random input, and compare every backend this device has "
        "(ONNX Runtime CPU, CUDA, TensorRT EP, native TensorRT) on the same model and input",
    )
    parser.add_argument("--iterations", type=int, default=DEFAULT_ITERATIONS, help="timed runs for --bench")
    parser.add_argument("--batch", type=int, default=1, help="batch size for --bench")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--state-dir", type=Path, help=f"engine cache root (default {default_state_dir()})")
    where.add_argument(
        "-c", "--config", type=Path, help="agent config: use its state_dir and engines settings"
    )
    parser.add_argument("--timeout", type=float, help="build timeout in seconds (default: the config's)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of text")


def _spec(args: argparse.Namespace) -> BuildSpec:
    from agent.specs.build import BuildSpec, CalibrationSource

    calibration: CalibrationSource | None = None
    if args.calib is not None and args.calib_cache is not None:
        raise BuildError("give --calib or --calib-cache, not both")
    if args.calib_from is not None and args.calib_cache is not None:
        raise BuildError("give --calib-from or --calib-cache, not both")
    if args.calib is not None:
        calibration = CalibrationSource(kind="dataset", path=args.calib, frames=args.calib_frames)
    elif args.calib_cache is not None:
        calibration = CalibrationSource(kind="cache", path=args.calib_cache)
    try:
        return BuildSpec(
            precision=args.precision,
            device=args.engine_device,
            gpu_fallback=not args.no_gpu_fallback,
            workspace_mb=args.workspace_mb,
            optimization_level=args.opt_level,
            calibration=calibration,
        )
    except ValueError as exc:
        raise BuildError(f"invalid build options: {exc}") from exc


def _check_int8_scales(model: Path, spec: BuildSpec) -> None:
    """INT8 needs scales: say so in this command's flags (the planner's own message speaks of the
    build spec of a deploy manifest)."""
    if spec.precision != "int8" or spec.calibration is not None:
        return
    from agent.model_contract.model_facts import model_facts

    _, has_qdq = model_facts(model)
    if not has_qdq:
        raise UsageError(
            f"--precision int8: {model.name} is not quantized (no Q/DQ nodes), so INT8 needs scales: "
            "add --calib DIR (images to calibrate on) or --calib-cache FILE, or use --precision fp16"
        )


def _preprocess(args: argparse.Namespace) -> PreprocessSpec | None:
    if args.calib is None:
        return None
    from agent.model_contract.model_facts import model_input_size
    from agent.specs.preprocess import PreprocessSpec

    size = model_input_size(args.model)
    width = args.width or (size[0] if size else None)
    height = args.height or (size[1] if size else None)
    if width is None or height is None:
        raise BuildError(f"{args.model.name} has no fixed input size: give --width and --height for --calib")
    return PreprocessSpec(width=width, height=height)


def calib_dir_for(source: str) -> Path:
    """Where ``--calib-from SOURCE`` writes its frames without ``--calib``: ``./calib-<name>``."""
    name = source.rstrip("/").rsplit("/", 1)[-1].split("?", 1)[0]
    stem = Path(name).stem or "stream"
    return Path(f"calib-{stem}")


def _frames_from_video(args: argparse.Namespace) -> None:
    """``--calib-from``: fill ``--calib`` (default ./calib-<name>) with frames, then calibrate on it."""
    from agent.engines.calibration.video import write_calibration_frames

    if args.precision not in ("int8", "best"):
        raise BuildError(
            f"--calib-from makes INT8 calibration images: add --precision int8 (not {args.precision})"
        )
    if args.calib is None:
        args.calib = calib_dir_for(args.calib_from)
    written = write_calibration_frames(
        args.calib_from,
        args.calib,
        args.calib_frames,
        progress=None if args.json else lambda m: print(f"  ...      {m}", file=sys.stderr, flush=True),
    )
    args.calib_written = len(written)
    if not args.json:
        print(f"calib      {len(written)} frames of {args.calib_from} written to {args.calib}/", flush=True)
        if len(written) < args.calib_frames:
            # A short video (or an ended stream) gives fewer than asked: say so.
            print(
                f"calib      {len(written)} of the {args.calib_frames} frames asked (--calib-frames): "
                f"{args.calib_from} gave no more; fewer frames calibrate less representatively",
                flush=True,
            )


def _settings(args: argparse.Namespace) -> tuple[Path, EngineConfig]:
    from agent.engines.settings import EngineConfig

    if args.config is not None:
        from agent.config import load_config

        config = load_config(args.config)
        state_dir, engines = config.state_dir, config.engines
    else:
        state_dir, engines = args.state_dir or default_state_dir(), EngineConfig()
    if args.timeout is not None:
        engines = engines.model_copy(update={"build_timeout_s": args.timeout})
    return Path(state_dir), engines


def _placement_text(effective: dict[str, Any]) -> str:
    placement = effective.get("placement")
    if not isinstance(placement, dict):
        return "not reported"
    if "dla_layers" in placement:
        return (
            f"{placement.get('dla_layers', 0)} layers on DLA, {placement.get('gpu_layers', 0)} on GPU "
            f"(from the {placement.get('source', '?')})"
        )
    return "providers " + ", ".join(str(p) for p in placement.get("providers", []))


def _print_text(
    model: Path, artifact: EngineArtifact, seconds: float, bench_result: dict[str, Any] | None
) -> None:
    plan = artifact.plan
    device = plan.device if plan.dla_core is None else f"dla{plan.dla_core}"
    requested = artifact.effective.get("requested", {})
    print(f"model      {model}")
    print(f"requested  precision {requested.get('precision')}, device {requested.get('device')}")
    print(
        f"plan       backend {plan.backend}, device {device}, precision {plan.precision}, "
        f"int8 {plan.int8_mode}{', gpu fallback' if plan.gpu_fallback else ''}"
    )
    for change in plan.changes:
        print(f"  change   {change.field}: {change.requested} -> {change.effective} ({change.reason})")
    if not plan.changes:
        print("  change   none: built as requested")
    state = "hit" if artifact.cache_hit else "miss, built and stored"
    built = artifact.effective.get("built_seconds")
    if artifact.cache_hit:
        print(f"build      cache hit in {seconds:.2f} s (originally built in {built or 0:.1f} s)")
    else:
        print(f"build      {built or seconds:.2f} s (total {seconds:.2f} s)")
    print(f"cache      {state}: key {artifact.key}")
    print(f"engine     {artifact.engine_path} ({artifact.effective.get('engine_bytes')} bytes)")
    print(f"placement  {_placement_text(artifact.effective)}")
    calibration = artifact.effective.get("calibration")
    if isinstance(calibration, dict):
        table, trt_cache = calibration.get("table"), calibration.get("trt_cache")
        print(f"calib      {calibration.get('method')}: table {table}, TensorRT cache {trt_cache}")
    if bench_result is not None:
        print(
            f"bench      {bench_result['throughput_per_s']:.1f} inferences/s "
            f"(batch {bench_result['batch']}, {bench_result['iterations']} runs), latency "
            f"mean {bench_result['latency_ms_mean']:.2f} ms, p50 {bench_result['latency_ms_p50']:.2f} ms, "
            f"p99 {bench_result['latency_ms_p99']:.2f} ms; load {bench_result['load_s'] * 1000:.0f} ms, "
            f"first inference {bench_result['first_inference_s'] * 1000:.1f} ms"
        )


def _compare(  # noqa: PLR0917 - a private step of run_build, called once
    model: Path,
    spec: BuildSpec,
    builder: EngineBuilder,
    artifact: EngineArtifact,
    args: argparse.Namespace,
    progress: Callable[[str], None],
) -> list[ComparisonRow]:
    """Every backend of this device on the same model and input; native TensorRT built for the GPU
    (a cache hit when this build already was one, or was made before)."""
    from agent.measure.throughput import bench_candidates, compare_backends

    def native() -> EngineArtifact:
        return builder.build(model, spec.model_copy(update={"device": "gpu"}), progress=progress)

    return compare_backends(
        model,
        bench_candidates(builder.platform),
        iterations=args.iterations,
        batch=args.batch,
        native=native,
        built=artifact,
    )


def comparison_lines(rows: Sequence[ComparisonRow]) -> list[str]:
    """The ``compare`` lines of the text report: one per backend, measured, skipped or failed."""
    width = max((len(row.label) for row in rows), default=0)
    lines = []
    for row in rows:
        head = f"compare    {row.label:<{width}}"
        if row.status != "measured" or row.result is None:
            lines.append(f"{head}  {row.status}: {row.reason}")
            continue
        result = row.result
        diff = "" if row.max_abs_diff is None else f", max abs diff {row.max_abs_diff:.3g} vs first row"
        note = f" ({row.note})" if row.note else ""
        lines.append(
            f"{head}  {result['throughput_per_s']:.1f} inferences/s, p50 {result['latency_ms_p50']:.2f} ms, "
            f"p99 {result['latency_ms_p99']:.2f} ms{diff}{note}"
        )
    return lines


def quiet_logs() -> None:
    """Agent log events at warning and above, to stderr: stdout is the report (or the JSON)."""
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.dev.ConsoleRenderer(colors=False)],
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )


def run_build(args: argparse.Namespace) -> int:
    """``edge-agent build``: returns the exit status; raises AgentError for the CLI to print."""
    from agent.engines.building.builder import EngineBuilder
    from agent.machine.platform import detect_platform
    from agent.measure.throughput import THIS_BUILD, bench

    quiet_logs()

    model = Path(args.model)
    if not model.is_file():
        raise BuildError(f"model {model} does not exist")
    if args.iterations < 1 or args.batch < 1:
        raise BuildError("--iterations and --batch must be >= 1")
    if args.calib_from is not None:
        _frames_from_video(args)
    spec = _spec(args)
    _check_int8_scales(model, spec)
    preprocess = _preprocess(args)
    state_dir, engines = _settings(args)
    builder = EngineBuilder(state_dir, engines, detect_platform())
    quiet = args.json

    def progress(message: str) -> None:
        # The plan's changes are printed with the report; the rest is live progress.
        if not quiet and not message.startswith("plan: "):
            print(f"  ...      {message}", file=sys.stderr, flush=True)

    started = time.monotonic()
    artifact = builder.build(model, spec, preprocess=preprocess, progress=progress)
    seconds = time.monotonic() - started
    agreement = None
    if artifact.plan.precision == "int8" and args.calib is not None and preprocess is not None:
        from agent.measure.int8_agreement import MAX_FRAMES, int8_agreement

        progress("comparing the INT8 build with FP32 on the calibration images")
        agreement = int8_agreement(
            model, artifact, args.calib, preprocess, min(args.calib_frames, MAX_FRAMES)
        )
    bench_result: dict[str, Any] | None = None
    rows: list[ComparisonRow] = []
    if args.bench:
        rows = _compare(model, spec, builder, artifact, args, progress)
        ours = [row for row in rows if row.note == THIS_BUILD and row.result is not None]
        bench_result = ours[0].result if ours else bench(artifact, args.iterations, args.batch)
    if args.json:
        document = {
            "model": str(model),
            "key": artifact.key,
            "cache_hit": artifact.cache_hit,
            "engine": str(artifact.engine_path),
            "backend": artifact.backend,
            "seconds": seconds,
            "plan": artifact.plan.model_dump(mode="json"),
            "effective": artifact.effective,
            "bench": bench_result,
            "compare": [row.as_dict() for row in rows],
            "int8_agreement": agreement.as_dict() if agreement is not None else None,
            "calibration_frames": (
                {"asked": args.calib_frames, "written": args.calib_written}
                if getattr(args, "calib_written", None) is not None
                else None
            ),
        }
        print(json.dumps(document, indent=2, default=str))
    else:
        _print_text(model, artifact, seconds, bench_result)
        if agreement is not None:
            print(f"agreement  {agreement.line()}")
        for line in comparison_lines(rows):
            print(line)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry (``python -m agent.cli.build``), same as ``edge-agent build``."""
    from agent.cli.help_format import CliParser

    parser = CliParser(prog="edge-agent build", description=__doc__.splitlines()[0])
    add_build_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_build(args)
    except AgentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
