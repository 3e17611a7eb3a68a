"""What the device says about itself: the retained ``up/info`` message, the telemetry it publishes
(and serves on the opt-in ``/metrics``), the ``status`` command's report, the slots' figures, and the
one line systemd shows.

One job (the device's reports, read from the components as they are now); part of the composition
root: :class:`~agent.app.root.Agent` builds it and calls it when something worth reporting changed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agent import __version__
from agent.app.frame_paths import FramePaths
from agent.config import AgentConfig
from agent.delivery.service import DeliveryService
from agent.machine.platform import Platform, platform_summary
from agent.mqtt.link import MqttLink
from agent.protocol.device_targets import TargetInfo
from agent.protocol.messages import (
    BackendInfo,
    CameraInfo,
    CertificateInfo,
    EngineInfo,
    InfoMessage,
    SlotBuildInfo,
    SlotInfo,
    TelemetryMessage,
)
from agent.protocol.topics import Topics
from agent.runtime.slots.loaded import runs_of_model
from agent.runtime.slots.models.choice import SlotModels
from agent.runtime.slots.slot import ModelSlot
from agent.telemetry import Metrics
from agent.telemetry.prometheus import TelemetryEndpoint


class DeviceReports:
    """The device's reports, each built from the components at the time it is asked for."""

    def __init__(
        self,
        config: Callable[[], AgentConfig],
        *,
        platform: Platform,
        slots: dict[str, ModelSlot],
        models: SlotModels,
        delivery: DeliveryService,
        frames: FramePaths,
        link: MqttLink,
        topics: Topics,
        metrics: Metrics,
        metrics_endpoint: TelemetryEndpoint | None,
        certificate: Callable[[], CertificateInfo | None] = lambda: None,
        agent_release: Callable[[], TargetInfo | None] = lambda: None,
        config_overlay: Callable[[], TargetInfo | None] = lambda: None,
    ) -> None:
        """``certificate``: the client certificate the device connects with, for up/info;
        ``agent_release``: the agent release that runs and the one on trial;
        ``config_overlay``: the configuration overlay it runs (target ``_config``)."""
        #: The configuration in force (a reload replaces it).
        self._config = config
        self.platform = platform
        self.slots = slots
        self.models = models
        self.delivery = delivery
        self.frames = frames
        self.link = link
        self.topics = topics
        self.metrics = metrics
        self.metrics_endpoint = metrics_endpoint
        self.certificate = certificate
        self.agent_release = agent_release
        self.config_overlay = config_overlay

    def info_message(self) -> InfoMessage:
        """``up/info``: the platform, its backends, every slot (model, job, layout, engines, build)."""
        config = self._config()
        backends = {
            name: BackendInfo(available=ok, reason=why) for name, (ok, why) in self.platform.backends.items()
        }
        layouts = self.frames.layouts
        slots = {}
        for name, slot in self.slots.items():
            model = slot.current
            slots[name] = SlotInfo(
                model=model.ref if model else None,
                state=slot.state.value,
                reason=None if model else slot.empty_reason,
                since=model.loaded_at if model else None,
                **self.delivery.job_fields(name),
                **self.delivery.release_fields(model.ref.sha256 if model else None),
                workers=layouts[name].workers,
                layout=layouts[name].reason,
                engines=[EngineInfo.model_validate(row) for row in model.engine_shares()] if model else None,
                serving=self.models.serving(name),
                building=_slot_build(self.models.builds.info(name)),
                runs=runs_of_model(model) if model else None,
            )
        return InfoMessage(
            device_id=config.device_id,
            agent_version=__version__,
            platform=platform_summary(self.platform),
            labels=dict(config.labels),
            backends=backends,
            slots=slots,
            streams=list(config.streams),
            cameras={
                name: CameraInfo(
                    state=report.state.value,
                    since=report.since,
                    frames=report.frames,
                    reconnects=report.reconnects,
                    last_error=report.last_error,
                    last_error_at=report.last_error_at,
                )
                for name, report in self.frames.cameras().items()
            },
            certificate=self.certificate(),
            agent_release=self.agent_release(),
            config=self.config_overlay(),
        )

    def publish_info(self) -> None:
        """Publish ``up/info`` (retained: ``fleet status`` reads each slot's last job from it)."""
        self.link.publish(self.topics.info, self.info_message(), qos=1, retain=True)

    def publish_telemetry(self, values: dict[str, float]) -> None:
        """One telemetry message: to ``/metrics`` (when served) and to the broker."""
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.update(values)  # before publishing: a broker outage must not hide it
        self.link.publish(self.topics.telemetry, TelemetryMessage.model_validate(values), qos=0)

    def status_report(self) -> dict[str, Any]:
        """``status`` command: slots, state.json and every metric."""
        return {
            "device_id": self._config().device_id,
            "agent_version": __version__,
            "slots": {name: slot.describe() for name, slot in self.slots.items()},
            "state": self.models.snapshot(),
            "metrics": self.metrics.snapshot(),
        }

    def slot_stats(self) -> dict[str, float]:
        """Per slot, for telemetry (``slot.*``): whether it serves, which model, swaps, failed loads."""
        stats: dict[str, float] = {}
        for name, slot in self.slots.items():
            model = slot.current
            stats[f"{name}.active"] = 1.0 if model else 0.0
            # Telemetry is numeric: the model is identified by the first 7 hex digits of its sha256.
            stats[f"{name}.model_sha7"] = float(int(model.ref.sha256[:7], 16)) if model else 0.0
            stats[f"{name}.swaps"] = float(slot.swaps)
            stats[f"{name}.failed_loads"] = float(slot.failed_loads)
        return stats

    def status_line(self) -> str:
        """The line systemd shows (``systemctl status``): what each slot serves, or why it is empty."""
        parts = []
        for name, slot in self.slots.items():
            model = slot.current
            parts.append(
                f"{name}={model.ref.model_id}:{model.ref.version or '-'}"
                if model
                else f"{name}=empty ({slot.empty_reason})"
            )
        return "serving " + " ".join(parts) if parts else "no slots configured"


def _slot_build(info: dict[str, object] | None) -> SlotBuildInfo | None:
    return SlotBuildInfo.model_validate(info) if info is not None else None
