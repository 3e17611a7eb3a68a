"""Asking devices directly: commands and their replies (snapshots, evidence, logs), and which devices a
command targets.
"""
