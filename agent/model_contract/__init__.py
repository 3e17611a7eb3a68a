"""What a model and its deployed files must be: checked before signing and again on the device."""
