"""The agent's configuration: pydantic models, loaded from YAML with environment overrides.

Loading (``load_config``) is implemented below the models.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from agent.camera.preprocess_spec import PreprocessSpec
from agent.camera.source_spec import SourceSpec
from agent.model_base import StrictModel
from agent.mqtt.settings import MqttSettings
from agent.postprocess.spec import ClassificationSpec, PostprocessSpec

#: Device ids, slot and stream names become MQTT topic levels and file names.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
Name = Annotated[str, Field(pattern=NAME_PATTERN.pattern)]


class SlotConfig(StrictModel):
    """A model slot: one model at a time, hot-swappable, shared by any number of streams."""

    model: Path = Field(description="ONNX model file (relative paths are from the config file).")
    model_id: str | None = Field(None, description="Name reported with results; default: the file stem.")
    version: str | None = Field(None, description="Version reported with results.")
    backend: str = Field("onnxruntime", description="Inference backend key.")
    providers: list[str] = Field(
        default_factory=lambda: ["CPUExecutionProvider"],
        description="ONNX Runtime providers in order of preference; missing ones are skipped.",
    )
    intra_op_threads: int = Field(0, ge=0, description="ONNX Runtime threads per inference (0 = default).")
    max_batch: int = Field(4, ge=1, le=64, description="Most frames run in one batch when streams share a slot.")
    preprocess: PreprocessSpec = Field(default_factory=PreprocessSpec)  # type: ignore[arg-type]
    postprocess: PostprocessSpec = Field(default_factory=ClassificationSpec)  # type: ignore[arg-type]


class StreamConfig(StrictModel):
    """A camera stream feeding one slot."""

    source: SourceSpec
    slot: Name = Field(description="Slot (key of ``slots``) whose model processes this stream.")
    fps_limit: float | None = Field(None, gt=0, description="Process at most this many frames per second.")
    drop_policy: Literal["auto", "keep_newest", "process_all"] = Field(
        "auto",
        description="When inference falls behind: keep_newest drops old frames (live cameras), "
        "process_all blocks capture (files). auto picks by source type.",
    )
    queue_size: int = Field(4, ge=1, le=1024, description="Frames buffered between capture and inference.")
    results_qos: Literal[0, 1] = Field(0, description="MQTT QoS of result messages.")
    durable_results: bool = Field(False, description="Spool results to disk so none is lost (implies QoS 1).")


class TelemetryConfig(StrictModel):
    """Periodic telemetry on ``up/telemetry``."""

    interval_s: float = Field(10.0, gt=0, description="Seconds between telemetry messages.")
    sysfs_root: Path = Field(Path("/"), description="Root for /sys and /proc reads (tests point it elsewhere).")


class LoggingConfig(StrictModel):
    """structlog output."""

    format: Literal["json", "console"] = Field("json", description="json for journald, console for humans.")
    level: Literal["debug", "info", "warning", "error"] = Field("info", description="Lowest level logged.")


class AgentConfig(StrictModel):
    """The whole configuration file."""

    device_id: Name = Field(description="Device id: MQTT client id, topic level and certificate CN.")
    state_dir: Path = Field(Path("/var/lib/edge-agent"), description="Models, engines, state.json, spool.")
    mqtt: MqttSettings = Field(default_factory=MqttSettings)  # type: ignore[arg-type]
    slots: dict[Name, SlotConfig] = Field(default_factory=dict)
    streams: dict[Name, StreamConfig] = Field(default_factory=dict)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)  # type: ignore[arg-type]
    logging: LoggingConfig = Field(default_factory=LoggingConfig)  # type: ignore[arg-type]

    @model_validator(mode="after")
    def _streams_name_known_slots(self) -> AgentConfig:
        for name, stream in self.streams.items():
            if stream.slot not in self.slots:
                known = ", ".join(sorted(self.slots)) or "none"
                raise ValueError(f"streams.{name}.slot: no slot named {stream.slot!r} (slots: {known})")
        return self
