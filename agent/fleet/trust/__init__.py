"""The operator's fleet root of trust: keys made and root versions signed offline, releases signed with the
release key, and the root chain published to every device (``edge-agent fleet trust``)."""
