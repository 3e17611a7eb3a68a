"""Every slot's frame path, wired: its streams' plans, its pipeline with the layout its first model
allows, the opt-in samplers, and what the rest of the agent asks of them (the latest frame, a
stream's snapshot, live frames to calibrate on, whether a frame loop is stuck).

One job (building the frame paths from the config and answering for them); part of the
composition root: :class:`~agent.app.root.Agent` builds one and starts it after the slots' first load.
"""

from __future__ import annotations

import threading
from functools import partial

import numpy as np
import numpy.typing as npt
import structlog

from agent.camera.framing import Framing
from agent.camera.gst_pipelines import scaled_for
from agent.camera.source import SourceEvent, SourceReport, VideoSource
from agent.config import AgentConfig, StreamConfig
from agent.machine.cpus import usable_cpus
from agent.mqtt.link import MqttLink
from agent.protocol.topics import Topics
from agent.runtime.frames.layout import Layout, slot_layout
from agent.runtime.frames.pipeline import SlotPipeline
from agent.runtime.frames.samples import SamplePublisher, Sampler
from agent.runtime.frames.snapshots import Snapshot
from agent.runtime.frames.stage_items import StreamPlan, StreamTuning, TuningDial
from agent.runtime.slots.slot import ModelSlot
from agent.telemetry import Metrics

log = structlog.get_logger(__name__)

#: How long calibration or the INT8 guard waits for live frames.
FRAME_TAP_TIMEOUT_S = 60.0
#: A frame path that has not turned over in this long is reported dead to the watchdog.
HEARTBEAT_STALE_S = 10.0


class FramePaths:
    """The pipelines of every slot that has streams (none until :meth:`build`)."""

    def __init__(
        self,
        config: AgentConfig,
        topics: Topics,
        link: MqttLink,
        metrics: Metrics,
        stop_event: threading.Event,
    ) -> None:
        self.config = config
        self.topics = topics
        self.link = link
        self.metrics = metrics
        self.stop_event = stop_event
        #: Each slot's layout (workers, batch): first from its config, then again once its first
        #: model is loaded (:meth:`build`); up/info reports it.
        self.layouts: dict[str, Layout] = {name: self.layout(name) for name in config.slots}
        self.pipelines: list[SlotPipeline] = []
        # Set once the pipelines exist: a deployment whose manifest arrives (retained) while the
        # first models load must wait for them before it can tap live frames for calibration.
        self._built = threading.Event()
        #: Publishes the opt-in samples for retraining (None: no slot samples).
        self.samples: SamplePublisher | None = None
        #: Set when a camera source changed state: the composition root republishes ``up/info``.
        self.cameras_changed = threading.Event()

    def layout(self, slot: str, model_ms: float | None = None, engines: int | None = None) -> Layout:
        """Slot ``slot``'s layout on this machine's CPUs (given its model's run time, when known)."""
        streams = [s for s in self.config.streams.values() if s.slot == slot]
        return slot_layout(self.config.slots[slot], streams, usable_cpus(), model_ms, engines)

    def build(self, slots: dict[str, ModelSlot]) -> None:
        """Build the pipelines of ``slots``, after their first load (started by :meth:`start`)."""
        self.pipelines = self._build_pipelines(slots)
        self._built.set()

    def start(self) -> None:
        """Start every pipeline."""
        for pipeline in self.pipelines:
            pipeline.start()

    def _build_pipelines(self, slots: dict[str, ModelSlot]) -> list[SlotPipeline]:
        pipelines = []
        for slot_name, slot in slots.items():
            plans = []
            for stream_name, stream in self.config.streams.items():
                if stream.slot != slot_name:
                    continue
                # A camera pipeline scales frames to this slot's input before they reach the CPU.
                model = slot.current
                preprocess = model.preprocess if model else self.config.slots[slot_name].preprocess
                source = VideoSource(
                    stream_name, scaled_for(stream.source, preprocess), on_event=self._camera_changed
                )
                policy = stream.drop_policy
                if policy == "auto":
                    policy = "keep_newest" if source.is_live else "process_all"
                plans.append(
                    StreamPlan(
                        name=stream_name,
                        source=source,
                        slot=slot_name,
                        topic=self.topics.results(stream_name),
                        policy=policy,
                        queue_size=stream.queue_size,
                        tuning=TuningDial(stream_tuning(stream)),
                        qos=1 if stream.durable_results else stream.results_qos,
                        durable=stream.durable_results,
                    )
                )
                self.metrics.rate(f"stream.{stream_name}.fps", f"stream.{stream_name}.frames_published")
                self.metrics.rate(
                    f"stream.{stream_name}.capture_fps", f"stream.{stream_name}.frames_captured"
                )
                self.metrics.add_collector(source.stats, prefix=f"stream.{stream_name}.source")
            if plans:
                slot_config = self.config.slots[slot_name]
                # Decided again now that the first model is loaded: its measured run time can keep
                # a small model on one worker.
                current = slot.current
                layout = self.layout(
                    slot_name,
                    current.runner.probe_ms if current is not None else None,
                    len(current.engines) if current is not None else None,
                )
                self.layouts[slot_name] = layout
                slot.parallel_runs = layout.workers
                pipelines.append(
                    SlotPipeline(
                        slot,
                        plans,
                        self.link,
                        self.metrics,
                        max_batch=layout.max_batch or slot_config.max_batch,
                        workers=layout.workers,
                        publish_wake=layout.publish_wake,
                    )
                )
                log.info(
                    "pipeline.layout",
                    slot=slot_name,
                    workers=layout.workers,
                    max_batch=layout.max_batch or slot_config.max_batch,
                    reason=layout.reason,
                )
        return pipelines

    def start_samples(self) -> None:
        """Opt-in per slot: a sampler on each sampling slot's frame board, one thread publishing."""
        self.samples = self._start_samples()

    def _start_samples(self) -> SamplePublisher | None:
        samplers = []
        for pipeline in self.pipelines:
            config = self.config.slots[pipeline.slot.name].samples
            if config.enabled:
                sampler = Sampler(config, pipeline.slot.name)
                pipeline.snapshots.on_paired = sampler.offer
                samplers.append(sampler)
        if not samplers:
            return None
        publisher = SamplePublisher(
            samplers,
            lambda message: self.link.publish(self.topics.samples, message, qos=1),
            partial(self.link.payload_limit, self.topics.samples),
            self.stop_event,
        )
        self.metrics.add_collector(publisher.stats, prefix="samples")
        publisher.start()
        return publisher

    def retune(self, streams: dict[str, StreamConfig]) -> list[str]:
        """Apply ``streams``' fps_limit, rotate and roi to the running streams whose tuning they
        change (a reload); the names of those streams. Nothing else of any stream is touched."""
        retuned = []
        for pipeline in self.pipelines:
            for plan in pipeline.streams:
                config = streams.get(plan.name)
                if config is None:
                    continue
                tuning = stream_tuning(config)
                if tuning != plan.tuning.current and pipeline.retune(plan.name, tuning):
                    retuned.append(plan.name)
                    log.info(
                        "stream.retuned",
                        stream=plan.name,
                        fps_limit=tuning.fps_limit,
                        rotate=tuning.framing.rotate,
                        roi=config.roi.model_dump() if config.roi else None,
                    )
        return retuned

    def _camera_changed(self, _event: SourceEvent) -> None:
        # Called under the source's lock: only flags (the event itself is logged by the source).
        self.cameras_changed.set()

    # -- what the rest of the agent asks of them ------------------------------------------------

    def cameras(self) -> dict[str, SourceReport]:
        """Every running stream's camera source, by stream name (up/info's ``cameras``)."""
        return {plan.name: plan.source.report() for p in self.pipelines for plan in p.streams}

    def pipeline(self, slot: str) -> SlotPipeline | None:
        """Slot ``slot``'s pipeline (None: no streams, or not built yet)."""
        return next((p for p in self.pipelines if p.slot.name == slot), None)

    def latest_frame(self, slot: str) -> npt.NDArray[np.uint8] | None:
        """The last frame slot ``slot`` ran (validation samples a model on it)."""
        pipeline = self.pipeline(slot)
        return pipeline.last_image if pipeline else None

    def latest_snapshot(self, stream: str) -> Snapshot | None:
        """Stream ``stream``'s latest frame with its result (the ``snapshot`` command)."""
        for pipeline in self.pipelines:
            if any(plan.name == stream for plan in pipeline.streams):
                return pipeline.snapshots.latest(stream)
        return None

    def tap_frames(self, slot: str, n: int) -> list[npt.NDArray[np.uint8]]:
        """``n`` live frames of slot ``slot`` (calibration, the INT8 guard); fewer after a timeout."""
        self._built.wait(FRAME_TAP_TIMEOUT_S)
        pipeline = self.pipeline(slot)
        return pipeline.tap(n, every=2, timeout_s=FRAME_TAP_TIMEOUT_S) if pipeline else []

    def alive(self, stuck_call_s: float) -> bool:
        """The watchdog's check: every frame loop turned over lately and no call is stuck longer than
        ``stuck_call_s``."""
        problems = [
            problem for p in self.pipelines for problem in p.problems(HEARTBEAT_STALE_S, stuck_call_s)
        ]
        if problems:
            # The watchdog's own line names only the check; this one says what is stuck, and where.
            log.warning("pipeline.stuck", problems=problems, stuck_call_s=stuck_call_s)
        return not problems

    def stop(self, deadline: float) -> None:
        """Stop every pipeline (frames first, then the inference drain) by ``deadline`` (monotonic)."""
        for pipeline in self.pipelines:
            pipeline.stop(deadline)


def stream_tuning(stream: StreamConfig) -> StreamTuning:
    """What of ``stream``'s configuration a reload changes on the running stream."""
    return StreamTuning(stream.fps_limit, Framing(stream.rotate, stream.roi))
