"""The ``engines:`` section of the configuration: the engine cache and the build worker."""

from __future__ import annotations

from pydantic import Field

from agent.model_base import StrictModel


class StartupGuard(StrictModel):
    """The bars an engine built at start-up passes before it replaces the ONNX model that served
    meanwhile, when the model's deployment shared engines (then it is offered to the fleet): a
    manifest's ``shadow`` and ``probation`` bars (docs/protocol.md), the ONNX model as the serving one.
    Rejected or unhealthy, the ONNX model serves on and nothing is offered."""

    shadow_frames: int = Field(30, ge=1, le=100_000, description="Live frames the shadow compares.")
    min_agreement: float | None = Field(
        0.9, ge=0.0, le=1.0, description="Least agreement with the ONNX model."
    )
    max_latency_ratio: float = Field(
        2.0, gt=0.0, description="Most the engine's median inference time, as a multiple of the ONNX model's."
    )
    shadow_timeout_s: float = Field(600.0, gt=0.0, le=3600.0, description="Longest the shadow runs.")
    probation_s: float = Field(60.0, gt=0.0, le=86_400, description="The probation after the swap, seconds.")
    min_fps_ratio: float = Field(
        0.8, ge=0.0, le=1.0, description="Least fps per stream, share of the ONNX model's."
    )
    max_p99_ratio: float = Field(
        3.0,
        gt=0.0,
        description="Most the engine's inference time, multiple of the ONNX model's on the same frames "
        "at the same moments.",
    )
    max_drop_increase: float = Field(0.1, ge=0.0, le=1.0, description="Most the dropped share may rise.")


class EngineConfig(StrictModel):
    """Where engines are cached and how builds are bounded."""

    cache_max_mb: int = Field(4096, ge=1, description="Engine cache size cap; least recently used go first.")
    serve_while_building: bool = Field(
        True,
        description="A slot whose engine is not in the cache at start-up serves its ONNX model on ONNX "
        "Runtime at once and swaps to the engine once built and validated (false: it waits for the build).",
    )
    fleet_ask_timeout_s: float = Field(
        10.0,
        gt=0,
        le=300,
        description="How long a build waits for the controller's answer when a deployment lets it take the "
        "engine from the fleet (share_engines); no answer: it builds here.",
    )
    fleet_wait_max_s: float = Field(
        1200.0,
        ge=0,
        le=86_400,
        description="How long in all a build waits for the engine another device of the fleet is building "
        "(the controller said 'being built by D'); the slot's current model, or at start-up its ONNX "
        "model, serves meanwhile. Past it, it builds here (0: never waits).",
    )
    startup_guard: StartupGuard = Field(
        default_factory=StartupGuard,
        description="A start-up build of a model whose deployment shared engines: the shadow and probation "
        "its engine passes against the ONNX model serving meanwhile before it may be offered to the fleet.",
    )
    build_timeout_s: float = Field(1800.0, gt=0, description="A build running longer is killed and fails.")
    build_memory_mb: int = Field(0, ge=0, description="Address-space limit of the build process (0 = none).")
    int8_agreement: float = Field(
        0.97,
        ge=0.0,
        le=1.0,
        description="INT8 goes live only if its top-1 agrees with FP32 on this share of frames.",
    )
    guard_frames: int = Field(64, ge=1, description="Held-out frames the INT8 accuracy guard compares on.")
    placement_seconds: float = Field(
        3.0,
        gt=0,
        le=60,
        description="device auto: how long each candidate engine, and each set of engines timed together, "
        "runs on live frames.",
    )
    placement_frames: int = Field(
        16, ge=1, le=1000, description="device auto: live frames the candidates are timed on (cycled)."
    )
    placement_dla_max_slowdown: float = Field(
        2.0,
        ge=1.0,
        description="prefer efficiency: the fastest DLA engine or DLA pair is kept unless its throughput is "
        "this many times below the fastest engine or set of engines.",
    )
