"""The fleet root of trust: which keys may sign what, new root versions taken only when a threshold of the
old and the new keys signed them, and a deployment checked against it (its release, the controller)."""
