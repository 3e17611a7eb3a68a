"""The agent's own record in its state directory: the slots' models, and the lock on the directory."""
