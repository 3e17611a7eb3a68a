"""What every slot runs: start-up choice, reloads, interim serving, deployments and rollback."""
