"""Engines shared across the fleet: the engine cache's second level at the controller, and its trust rules."""
