"""The MQTT link. The only package that imports paho."""

from agent.mqtt.inbox import InboundMessage
from agent.mqtt.link import MqttLink, PublishProperties

__all__ = ["InboundMessage", "MqttLink", "PublishProperties"]
