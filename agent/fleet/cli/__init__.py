"""``edge-agent fleet ...``: every command's flags, how it runs, and what it prints."""
