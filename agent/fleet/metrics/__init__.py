"""The controller's ``/metrics``: the fleet and its rollouts as Prometheus series."""
