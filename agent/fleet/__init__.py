"""The operator side: the fleet controller, its console and ``/metrics``, and every ``edge-agent fleet``
command, in rooms by job (base, view, devices, chunks, deploy, rollout, samples, metrics, console,
controller, cli; docs/architecture.md draws them and the one way their imports go)."""
