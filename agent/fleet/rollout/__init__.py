"""Rollouts: their shape, the gate between waves, the store of their state, the runner that drives them and
the report of them.
"""
