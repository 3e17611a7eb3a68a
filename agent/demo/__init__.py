"""``edge-agent demo``: the whole agent and the operator side on one machine, and what it runs on."""
