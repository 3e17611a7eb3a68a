"""What every room of the operator side shares: a device's messages made safe to keep and to print."""
