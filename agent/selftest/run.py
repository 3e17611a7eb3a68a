"""What the self-test's steps share: the sizes of a run (full or ``--quick``), the platform, a
builder on a scratch cache and the engines built so far.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import cv2

from agent.datasets import shapes
from agent.engines.building.artifact import EngineArtifact
from agent.engines.building.builder import EngineBuilder
from agent.machine.platform import Platform
from agent.selftest.targets import (
    Device,
    DeviceTarget,
    EnginePrecision,
    device_targets,
)

#: The bundled model's input size (shapes.MODEL_PATH: [batch, 3, 64, 64], RGB / 255).
INPUT_SIZE = 64
#: Engines the multi-engine step runs when fewer than two devices are usable: CPU sessions stand in.
CPU_STAND_INS = 3
#: Largest drop of free device memory the leak check accepts (allocator noise, not 1 MiB per cycle).
LEAK_TOLERANCE_BYTES = 8 * 2**20


@dataclass(frozen=True)
class Sizes:
    """How much each step does: the full run, or ``--quick``."""

    calibration_frames: int
    bench_iterations: int
    stream_frames: int
    leak_cycles: int


FULL = Sizes(calibration_frames=64, bench_iterations=300, stream_frames=300, leak_cycles=1000)
QUICK = Sizes(calibration_frames=16, bench_iterations=50, stream_frames=120, leak_cycles=200)


@dataclass
class SelfTestRun:
    """What the steps share: the platform, a builder on a scratch cache, and the engines built so far."""

    platform: Platform
    builder: EngineBuilder
    work_dir: Path
    sizes: Sizes
    model: Path = shapes.MODEL_PATH
    targets: list[DeviceTarget] = field(default_factory=list)
    engines: dict[tuple[Device, EnginePrecision], EngineArtifact] = field(default_factory=dict)
    #: Why an engine has no artifact (build failed or skipped), for the steps that need it.
    missing: dict[tuple[Device, EnginePrecision], str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.targets:
            self.targets = device_targets(self.platform)

    def calibration_dir(self) -> Path:
        """Shapes images to calibrate INT8 on, written once (seed 7: not the training seeds)."""
        folder = self.work_dir / "calibration-images"
        if not folder.is_dir():
            images, _ = shapes.generate(self.sizes.calibration_frames, seed=7, size=INPUT_SIZE)
            tmp = folder.with_name(folder.name + ".tmp")
            tmp.mkdir(parents=True, exist_ok=True)
            for i, image in enumerate(images):
                cv2.imwrite(str(tmp / f"shape-{i:04d}.png"), image)
            os.replace(tmp, folder)
        return folder
