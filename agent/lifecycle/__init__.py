"""The device's own configuration and agent release as desired state: checked, applied, watched, put back."""
