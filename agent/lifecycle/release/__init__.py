"""The agent's own release (``_agent``): installed side by side, switched by a link, confirmed or put back."""
