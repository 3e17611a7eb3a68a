"""The real mosquitto the tests start: :mod:`agent.localbroker` (shared with the demo and benchmarks)."""

from agent.localbroker import Broker, free_port, mosquitto_binary

__all__ = ["Broker", "free_port", "mosquitto_binary"]
