"""The MQTT link and clients. The only package that imports paho.

Import from the modules (``agent.mqtt.link``, ``agent.mqtt.settings``, ...): this package file stays
empty so that reading the configuration (``agent.mqtt.settings``) does not load paho.
"""
