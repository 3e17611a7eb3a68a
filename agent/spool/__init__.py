"""The on-disk outbox for MQTT messages that must survive a broker outage, a crash or a power cut."""
