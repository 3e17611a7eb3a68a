"""Model delivery: signed desired state, chunk pull with resume, verification, job status."""
