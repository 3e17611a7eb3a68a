"""Deployment jobs: the desired-state intake, a lane per slot, the job's steps, its ledger and statuses."""
