"""The configuration models: the YAML file's shape, each key with its default and description.

At the ground floor (docs/architecture.md): these models import nothing of the agent but names,
errors, the pydantic base and each package's own settings/spec model. Reading the file, environment
overrides and the operator's error text are in :mod:`agent.config.loading`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from agent.camera.source_spec import Region, SourceSpec
from agent.delivery.settings import DeliveryConfig
from agent.engines.settings import EngineConfig
from agent.enrollment.settings import EnrollmentSettings
from agent.model_base import StrictModel
from agent.mqtt.settings import MqttSettings
from agent.names import LabelKey, LabelValue, Name
from agent.specs.build import BuildSpec
from agent.specs.postprocess import ClassificationSpec, PostprocessSpec
from agent.specs.preprocess import PreprocessSpec
from agent.spool.settings import SpoolSettings


class SamplesConfig(StrictModel):
    """Frames kept for retraining (opt-in): the uncertain or unusual ones, bounded in rate and bytes.

    Off by default: frames leave the device only when the operator turns this on (privacy and
    bandwidth are the operator's choice; docs/fleet.md "Samples for retraining").
    """

    enabled: bool = Field(False, description="Publish sample frames on up/samples (off: nothing is kept).")
    max_confidence: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="A frame whose top-1 class score (classifier) or any detection score (detector) is "
        "below this is a sample.",
    )
    max_detections: int = Field(
        50,
        ge=1,
        le=10_000,
        description="A detector frame with more detections than this is unusual: a sample.",
    )
    per_minute: int = Field(
        2, ge=1, le=60, description="Most samples encoded and published per minute (a sliding 60 s window)."
    )
    max_bytes: int = Field(
        96 * 1024,
        ge=4096,
        le=1024 * 1024,
        description="Most JPEG bytes per sample; quality, then size, are lowered until it fits.",
    )
    max_dimension: int = Field(640, ge=16, le=8192, description="Longest side of a sample JPEG in pixels.")


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
    intra_op_threads: int = Field(
        0,
        ge=0,
        description="ONNX Runtime threads per inference; 0 = auto: the cores divided by the slot's "
        "inference workers, ORT's default for one worker, and 1 for a model that runs in under 1.5 ms "
        "per frame on the CPU (the other cores decode frames).",
    )
    allow_spinning: bool = Field(
        False,
        description="ONNX Runtime worker threads busy-wait between runs: lower latency on an idle "
        "many-core device, wasted CPU otherwise.",
    )
    max_batch: int = Field(
        4, ge=1, le=64, description="Most frames run in one batch when streams share a slot."
    )
    inference_workers: int = Field(
        0,
        ge=0,
        le=8,
        description="Inference threads running batches side by side; results are still published in "
        "the order frames were taken. 0 = auto: one single-threaded run per core (at most 4) for a "
        "CPU-only slot fed only by unpaced files (throughput), else 1 run over every core (latency).",
    )
    preprocess: PreprocessSpec = Field(default_factory=PreprocessSpec)
    postprocess: PostprocessSpec = Field(default_factory=ClassificationSpec)
    build: BuildSpec | None = Field(
        None, description="Engine build request; absent: run the ONNX model as it is on ONNX Runtime."
    )
    samples: SamplesConfig = Field(default_factory=SamplesConfig)


class StreamConfig(StrictModel):
    """A camera stream feeding one slot."""

    source: SourceSpec
    slot: Name = Field(description="Slot (key of ``slots``) whose model processes this stream.")
    fps_limit: float | None = Field(
        None,
        gt=0,
        description="Process at most this many frames per second (a reload applies it to this stream).",
    )
    rotate: Literal[0, 90, 180, 270] = Field(
        0,
        description="Turn every frame clockwise by this many degrees before anything else sees it "
        "(a camera mounted sideways or upside down; a reload applies it to this stream).",
    )
    roi: Region | None = Field(
        None,
        description="Region of interest: only this part of the (rotated) frame is preprocessed, inferred, "
        "snapshotted; results are in its pixels. null: the whole frame (a reload applies it to this stream).",
    )
    drop_policy: Literal["auto", "keep_newest", "process_all"] = Field(
        "auto",
        description="When inference falls behind: keep_newest drops old frames (live cameras), "
        "process_all blocks capture (files). auto picks by source type.",
    )
    queue_size: int = Field(4, ge=1, le=1024, description="Frames buffered between capture and inference.")
    results_qos: Literal[0, 1] = Field(0, description="MQTT QoS of result messages.")
    durable_results: bool = Field(False, description="Spool results to disk so none is lost (implies QoS 1).")


class PrometheusConfig(StrictModel):
    """The agent's own ``/metrics`` for Prometheus (off unless ``port`` is set)."""

    port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Serve the latest telemetry figures at http://HOST:PORT/metrics (needs the 'metrics' "
        "extra); null: no endpoint.",
    )
    host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="Address to bind: loopback unless told otherwise (0.0.0.0 for a remote Prometheus).",
    )


class TelemetryConfig(StrictModel):
    """Periodic telemetry on ``up/telemetry``."""

    interval_s: float = Field(10.0, gt=0, description="Seconds between telemetry messages.")
    sysfs_root: Path = Field(
        Path("/"), description="Root for /sys and /proc reads (tests point it elsewhere)."
    )
    prometheus: PrometheusConfig = Field(default_factory=PrometheusConfig)


class WatchdogConfig(StrictModel):
    """What the systemd watchdog (``WatchdogSec=``) counts as a stuck frame path."""

    stuck_call_s: float = Field(
        30.0,
        gt=0,
        description=(
            "A camera driver call (open/read/close) or an inference call still running after this "
            "many seconds withholds the watchdog ping. Keep it above the drivers' own timeouts "
            "(a URL source's open_timeout_s, 10 s, plus 3 s asking a camera that did not open why; "
            "10 s for a first GStreamer frame) and above the slowest inference of a batch."
        ),
    )


class LoggingConfig(StrictModel):
    """structlog output."""

    format: Literal["json", "console"] = Field("json", description="json for journald, console for humans.")
    level: Literal["debug", "info", "warning", "error"] = Field("info", description="Lowest level logged.")
    # The ``logs`` command reads these lines (redacted as they are kept); both bounds hold at once.
    ring_lines: int = Field(
        2000, ge=10, le=100_000, description="Latest log lines the agent keeps in memory for `logs`."
    )
    ring_bytes: int = Field(
        1024 * 1024, ge=16 * 1024, le=64 * 1024 * 1024, description="Most bytes those lines take."
    )


class SnapshotConfig(StrictModel):
    """The ``snapshot`` command: the latest frame of a stream as a JPEG, bounded by the operator."""

    max_dimension: int = Field(
        640, ge=16, le=8192, description="Longest side of the JPEG in pixels; larger frames are scaled down."
    )
    max_bytes: int = Field(
        150 * 1024,
        ge=1024,
        le=16 * 1024 * 1024,
        description="Most JPEG bytes; quality, then size, are lowered until it fits (and the MQTT limit).",
    )
    quality: int = Field(85, ge=10, le=100, description="JPEG quality tried first.")
    per_minute: int = Field(
        6, ge=0, le=600, description="Snapshots served per minute; more are answered rate_limited (0: none)."
    )


class AgentConfig(StrictModel):
    """The whole configuration file."""

    device_id: Name = Field(description="Device id: MQTT client id, topic level and certificate CN.")
    labels: dict[LabelKey, LabelValue] = Field(
        default_factory=dict,
        description="Labels the operator selects devices by (site: berlin-3, camera: dock), published in "
        "up/info; Kubernetes label rules, keys may not start with 'platform.' or 'agent.'.",
    )
    state_dir: Path = Field(Path("/var/lib/edge-agent"), description="Models, engines, state.json, spool.")
    mqtt: MqttSettings = Field(default_factory=MqttSettings)
    slots: dict[Name, SlotConfig] = Field(default_factory=dict)
    streams: dict[Name, StreamConfig] = Field(default_factory=dict)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    snapshot: SnapshotConfig = Field(default_factory=SnapshotConfig)
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)
    delivery: DeliveryConfig = Field(default_factory=DeliveryConfig)
    engines: EngineConfig = Field(default_factory=EngineConfig)
    spool: SpoolSettings = Field(default_factory=SpoolSettings)
    enrollment: EnrollmentSettings | None = Field(
        None,
        description="Enrollment by claim: the first start asks for the device's own certificate (written "
        "to mqtt.tls.cert_file) when it has none, and renews it before it expires; absent: the "
        "certificate is put in place by hand.",
    )

    @model_validator(mode="after")
    def _enrollment_has_somewhere_to_write(self) -> AgentConfig:
        tls = self.mqtt.tls
        if self.enrollment is not None and (
            tls is None or tls.ca_file is None or tls.cert_file is None or tls.key_file is None
        ):
            raise ValueError(
                "enrollment: needs mqtt.tls.ca_file (the fleet's trust anchors), mqtt.tls.cert_file and "
                "mqtt.tls.key_file (where the device's own certificate and key are written)"
            )
        return self

    @model_validator(mode="after")
    def _streams_name_known_slots(self) -> AgentConfig:
        for name, stream in self.streams.items():
            if stream.slot not in self.slots:
                raise ValueError(_unknown_slot_message(name, stream.slot, self.slots))
        return self


def unknown_slot_what(slot: str, slots: Iterable[Any]) -> str:
    """What is wrong with a stream naming ``slot``, which is none of ``slots``."""
    known = ", ".join(sorted(str(s) for s in slots)) or "none"
    return f"no slot named {slot!r} (slots: {known})"


def _unknown_slot_message(stream: str, slot: str, slots: Iterable[Any]) -> str:
    return f"streams.{stream}.slot: {unknown_slot_what(slot, slots)}"
