"""MQTT connection settings (the ``mqtt:`` section of the configuration)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, PrivateAttr

from agent.model_base import StrictModel


class TlsSettings(StrictModel):
    """TLS with an optional client certificate (the device id should be the certificate CN)."""

    ca_file: Path | None = Field(None, description="CA bundle that signed the broker certificate.")
    cert_file: Path | None = Field(None, description="Client certificate (PEM).")
    key_file: Path | None = Field(None, description="Client private key (PEM).")
    insecure: bool = Field(False, description="Skip broker hostname verification (testing only).")


class MqttSettings(StrictModel):
    """Broker address, credentials and the link's limits."""

    # Not a setting: what a user set the broker address with, so a connection error can name it
    # (a config file's keys, or the --broker flag of the operator CLI). See with_address_from().
    _address_from: str = PrivateAttr("mqtt.host/port")

    host: str = Field("localhost", description="Broker host name or address.")
    port: int = Field(1883, gt=0, lt=65536, description="Broker port (8883 for TLS by convention).")
    tls: TlsSettings | None = Field(None, description="TLS settings; absent means plain TCP.")
    username: str | None = Field(None, description="User name for password authentication.")
    password_file: Path | None = Field(None, description="File holding the password (secrets never inline).")
    prefix: str = Field("fleet/v1", description="Topic prefix before the device id.")
    client_id_prefix: str = Field(
        "",
        max_length=32,
        pattern=r"^[^\s/+#]*$",
        description="Put before every MQTT client id this process sends: the broker of docs/protocol.md "
        "accepts only client ids that start with its clientid_prefixes.",
    )
    keepalive_s: int = Field(
        30, ge=5, le=3600, description="MQTT keepalive; a dead link is seen after ~1.5x."
    )
    session_expiry_s: int = Field(
        3600, ge=0, description="Broker keeps the session (and queued commands) this long after a disconnect."
    )
    reconnect_min_s: float = Field(1.0, gt=0, description="First reconnect delay; doubles, with jitter.")
    reconnect_max_s: float = Field(60.0, gt=0, description="Longest reconnect delay.")
    max_payload_bytes: int = Field(
        256 * 1024, gt=0, description="Largest payload the agent publishes; larger ones are refused."
    )
    max_inflight: int = Field(
        20, ge=1, le=65535, description="QoS1 messages in flight (<= broker Receive Maximum)."
    )
    max_queued: int = Field(1000, ge=1, description="Non-durable QoS1 messages held in memory while offline.")
    inbox_size: int = Field(
        256, ge=1, description="Received messages waiting for dispatch; overflow is counted."
    )

    @property
    def address_from(self) -> str:
        """What set ``host``/``port``, as the user knows it: ``mqtt.host/port`` or ``--broker``."""
        return self._address_from

    def with_address_from(self, source: str) -> MqttSettings:
        """A copy whose connection errors tell the user to check ``source`` (e.g. ``--broker``)."""
        copy = self.model_copy()
        copy._address_from = source
        return copy
