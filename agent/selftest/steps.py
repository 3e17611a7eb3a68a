"""The self-test's steps, in the order they run, and the context they share.

Every step uses the agent's own code on this machine's hardware: the engine builder and its cache
(:mod:`agent.engines.building.builder`), the backend comparison of ``edge-agent build --bench``
(:mod:`agent.measure.throughput`), a model slot with a live pipeline (:mod:`agent.runtime`), the device
statistics telemetry publishes (:mod:`agent.telemetry.device`) and the CUDA wrappers TensorRT runs on
(:mod:`agent.backends.cuda`). The model is the bundled shapes classifier; INT8 calibrates on shapes
images generated on the spot, so nothing is downloaded.
"""

from __future__ import annotations

from agent.selftest.device_steps import cuda_buffers_step, cuda_leak_step, platform_step, telemetry_step
from agent.selftest.engine_steps import build_step, cache_step, compare_step, throughput_step
from agent.selftest.fleet_steps import downloaded_engine_step
from agent.selftest.run import SelfTestRun
from agent.selftest.runtime_steps import hotswap_step, multi_engine_step
from agent.selftest.step import Step
from agent.selftest.targets import BUDGET_S, PRECISIONS


def all_steps() -> list[Step[SelfTestRun]]:
    """Every step, in the order it runs."""
    steps: list[Step[SelfTestRun]] = [
        Step(
            "platform",
            BUDGET_S["platform"],
            "what this machine is, and which devices the rest tests",
            platform_step,
        )
    ]
    engines = [(d, p) for d in ("gpu", "dla0", "dla1", "cpu") for p in PRECISIONS]
    for device, precision in engines:
        steps.append(build_step(device, precision))  # type: ignore[arg-type]
        steps.append(cache_step(device, precision))  # type: ignore[arg-type]
        steps.append(throughput_step(device, precision))  # type: ignore[arg-type]
    steps += [
        Step(
            "compare.backends",
            BUDGET_S["compare.backends"],
            "build --bench: every backend here runs the same model and input (output differences listed)",
            compare_step,
        ),
        Step(
            "fleet.downloaded_engine",
            BUDGET_S["fleet.downloaded_engine"],
            "a TensorRT engine shared through the controller (signed, downloaded, verified) loads here "
            "and gives its builder's outputs",
            downloaded_engine_step,
        ),
        Step(
            "multi_engine.slot",
            BUDGET_S["multi_engine.slot"],
            "one slot serves frames from engines on every usable device at once",
            multi_engine_step,
        ),
        Step(
            "hotswap.synthetic_stream",
            BUDGET_S["hotswap.synthetic_stream"],
            "a hot-swap under a live stream loses no frame and never mixes versions",
            hotswap_step,
        ),
        Step(
            "telemetry.sysfs",
            BUDGET_S["telemetry.sysfs"],
            "telemetry reads this device's temperatures, GPU load and clocks (and DLA clocks as root)",
            telemetry_step,
        ),
        Step(
            "cuda.buffers",
            BUDGET_S["cuda.buffers"],
            "the CUDA wrappers TensorRT runs on copy data through pinned memory and streams intact",
            cuda_buffers_step,
        ),
        Step(
            "cuda.leak_check",
            BUDGET_S["cuda.leak_check"],
            "allocating and freeing CUDA buffers does not leak device memory",
            cuda_leak_step,
        ),
    ]
    return steps
