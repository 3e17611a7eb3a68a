"""Tests of the fleet's certificate authority (agent/fleet/ca)."""
