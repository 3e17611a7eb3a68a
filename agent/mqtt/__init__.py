"""MQTT: the paho core (``core.py``, the only module that imports paho) and its two users, the device's
link (``link.py``) and the operator's service client (``service_client.py``).

Import from the modules (``agent.mqtt.link``, ``agent.mqtt.settings``, ...): this package file stays
empty so that reading the configuration (``agent.mqtt.settings``) does not load paho.
"""
