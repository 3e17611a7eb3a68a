"""The fleet controller: the long-running process, its configuration, lease and API (and the CLI's side of
it).
"""
