"""The operator side a device enrolls with, all real: configs/mosquitto/ run as written (devices,
operators and enrollment listeners, a CA from ``fleet ca init``, a claim from ``fleet ca claim``) and a
real ``edge-agent fleet controller`` process with its enrollment desk on. No tests here.

The operator's client (:meth:`EnrollmentFleet.operator`) sees every request the devices send and can
put a message on any topic (a replayed reply); ``fleet devices`` verbs go to the controller as the CLI
sends them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.demo.broker import Broker
from agent.enrollment.settings import EnrollmentSettings
from agent.fleet.ca.authority import DeviceAuthority
from agent.fleet.ca.claims import ClaimBundle, make_claim
from agent.fleet.controller.client import ControllerClient
from agent.mqtt.inbound import InboundMessage
from agent.mqtt.service_client import ServiceClient
from agent.mqtt.settings import MqttSettings, TlsSettings
from agent.protocol.topics import enroll_request_filter, fleet_filter
from tests.fleet.ca.broker_rig import OPERATOR, EnrollmentBroker
from tests.fleet.controller_process import ControllerProcess

PREFIX = "fleet/v1"
#: What configs/mosquitto/'s clientid_prefixes asks of every client id.
CLIENT_ID_PREFIX = "fleet:"


@dataclass
class Seen:
    """A message the operator's client received, and when (monotonic seconds)."""

    topic: str
    payload: bytes
    at: float


@dataclass
class EnrollmentFleet:
    """The broker, the controller, one claim and the operator's client, for one test."""

    tmp: Path
    broker: EnrollmentBroker
    claim: ClaimBundle
    controller: ControllerProcess
    operator: ServiceClient | None = None
    seen: list[Seen] = field(default_factory=list)
    on_request: Callable[[Seen], None] | None = None

    # -- what a device is configured with ---------------------------------------------------------------

    def device_mqtt(self, device_dir: Path, **changes: object) -> MqttSettings:
        """A device's ``mqtt:``: the devices listener; its own certificate and key in ``device_dir``."""
        tls = TlsSettings(
            ca_file=self.claim.ca_file,
            cert_file=device_dir / "device.crt",
            key_file=device_dir / "device.key",
        )
        fields: dict[str, object] = {
            "host": self.broker.host,
            "port": self.broker.device_port,
            "tls": tls,
            "client_id_prefix": CLIENT_ID_PREFIX,
            "reconnect_min_s": 0.2,
            "reconnect_max_s": 1.0,
        }
        return MqttSettings.model_validate(fields | changes)

    def enrollment(self, **changes: object) -> EnrollmentSettings:
        """The ``enrollment:`` section for the claim, with short waits unless ``changes`` say otherwise."""
        fields: dict[str, object] = {
            "host": self.broker.host,
            "port": self.broker.enroll_port,
            "claim_cert_file": self.claim.cert_file,
            "claim_key_file": self.claim.key_file,
            "reply_timeout_s": 5.0,
            "retry_min_s": 0.2,
            "retry_max_s": 1.0,
        }
        return EnrollmentSettings.model_validate(fields | changes)

    # -- the operator ---------------------------------------------------------------------------------

    def operator_settings(self) -> MqttSettings:
        return MqttSettings(
            host=self.broker.host,
            port=self.broker.operator_port,
            prefix=PREFIX,
            tls=TlsSettings(ca_file=self.broker.ca.ca.root_cert),
            username=OPERATOR,
            password_file=self.tmp / "operator.password",
            client_id_prefix=CLIENT_ID_PREFIX,
            reconnect_min_s=0.2,
            reconnect_max_s=1.0,
        )

    def watch(self) -> ServiceClient:
        """The operator's client, subscribed to every enrollment and renewal request and reply."""
        self.operator = ServiceClient(self.operator_settings(), handler=self._seen).start()
        for topic_filter in (
            enroll_request_filter(PREFIX),
            f"{PREFIX}/enroll/+/reply",
            fleet_filter(PREFIX, "cert"),
            fleet_filter(PREFIX, "cert", "down"),
        ):
            self.operator.subscribe(topic_filter, qos=1)
        return self.operator

    def _seen(self, message: InboundMessage) -> None:
        seen = Seen(message.topic, message.payload, time.monotonic())
        self.seen.append(seen)
        if self.on_request is not None and message.topic.endswith(("/request", "/up/cert")):
            self.on_request(seen)

    def requests(self, kind: str = "/request") -> list[Seen]:
        """Requests seen so far: enrollment (``/request``) or renewal (``/up/cert``)."""
        return [s for s in list(self.seen) if s.topic.endswith(kind)]

    def devices(self, verb: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """``fleet devices VERB`` as the CLI sends it to the controller."""
        with ControllerClient(self.operator_settings(), timeout=60) as client:
            return client.request(f"devices_{verb}", body or {})

    def authority(self) -> DeviceAuthority:
        return self.broker.authority()

    def stop(self) -> None:
        if self.operator is not None:
            self.operator.stop()
        self.controller.kill()
        self.broker.stop()


def start_fleet(tmp: Path, *, uses: int = 50, **desk: object) -> EnrollmentFleet:
    """The documented broker, a claim of ``uses`` devices, and the controller with ``enrollment:``
    ``desk`` settings (over quick defaults: retry hints of 1 s, renewals allowed at once, one-day
    certificates)."""
    broker = EnrollmentBroker.start(tmp / "broker")
    claim = make_claim(broker.ca.ca.path, "batch-1", uses=uses, days=2, out_dir=tmp / "claim")
    (tmp / "operator.password").write_text(broker.operator_password + "\n")
    settings: dict[str, object] = {
        "ca_dir": str(broker.ca.ca.path),
        "certificate_days": 1,
        "pending_retry_s": 1.0,
        "refused_retry_s": 1.0,
        "rejected_retry_s": 1.0,
        "min_renew_interval_s": 0,
    } | desk
    stand_in = Broker(tmp / "unused", port=broker.operator_port)  # ControllerProcess reads host and port
    (tmp / "controller").mkdir()
    controller = ControllerProcess(tmp / "controller", stand_in, PREFIX)
    password = tmp / "operator.password"
    mqtt = (
        f"mqtt: {{host: {broker.host}, port: {broker.operator_port}, prefix: {PREFIX}, username: {OPERATOR}, "
        f"password_file: {password}, client_id_prefix: '{CLIENT_ID_PREFIX}', "
        f"tls: {{ca_file: {broker.ca.ca.root_cert}}}}}\n"
    )
    text = controller.config.read_text().splitlines(keepends=True)
    text[0] = mqtt
    enrollment = ", ".join(f"{key}: {value}" for key, value in settings.items())
    controller.config.write_text("".join(text) + f"enrollment: {{{enrollment}}}\n")
    fleet = EnrollmentFleet(tmp, broker, claim, controller.start())
    fleet.watch()
    return fleet
