"""The MQTT link. The only package that imports paho."""
