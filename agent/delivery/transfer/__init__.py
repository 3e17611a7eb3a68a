"""A model's bytes onto the device: the chunked MQTT pull, HTTP resume, a download that survives restarts."""
