"""The device's configuration as desired state: an overlay over agent.yaml, applied, watched, put back."""
