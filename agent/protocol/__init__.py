"""The MQTT protocol: topic tree and message models. The only place topics are spelled."""
