"""One deploy: a model checked, its manifest signed and published as the targets' desired state, their jobs
followed.
"""
