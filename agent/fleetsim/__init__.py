"""The fleet simulator: N devices built from the agent's own code, spread over a few processes.

For fleet-scale tests and ``bench/fleet.py``: a thousand devices on one machine, against one
broker, driven by the real operator side (``fleet deploy``, the rollout controller).

**Real** (the agent's own classes, wired as :mod:`agent.app.root` wires them, one set per device):

* the MQTT link (:class:`agent.mqtt.link.MqttLink`): its own MQTT 5 session and client id, the
  Last Will and the retained ``up/status`` with its session counter, reconnects with jittered
  backoff, durable publishes through the device's own SQLite spool (one difference: an idle link
  turns every 2 s, not every 0.5 s, :data:`agent.fleetsim.device.LINK_IDLE_LOOP_S`);
* the delivery service (:class:`agent.delivery.service.DeliveryService`): retained desired state,
  manifest and Ed25519 signature checks against the trusted key, replay and wrong-device refusals,
  the job ledger ``jobs.json`` and its one-terminal-state-per-job-id rule, the chunk pull over MQTT
  or HTTP with the MQTT fallback (``fetch_model``: windows, per-chunk SHA-256, ``.part`` + bitmap),
  the content-addressed model store, ``verify_model`` on the ONNX graph, job statuses through the
  spool, the ``status`` and ``rollback`` commands;
* the messages: ``up/info`` (:class:`~agent.protocol.messages.InfoMessage`, labels and the delivery
  service's job fields included), ``up/telemetry`` (with the link's and the spool's real counters),
  ``up/jobs/{job_id}``.

**Simulated** (:mod:`agent.fleetsim.slot`, :mod:`agent.fleetsim.device`): the model loop. No frame
runs, and no engine is built (``no_build``: the ONNX file as is) unless ``--build-seconds`` asks for
the build stand-in (:mod:`agent.fleetsim.build`: a sleep in place of the Jetson's TensorRT build,
around the agent's own engine cache key, engine cache and fleet engine cache against the real
controller); a delivered model is the slot's at
once, after SHADOW/PROBATION phases that report the figures the scenario dictates (healthy, or the
device's unhealthy figure) and end as the real guard ends (REJECTED below the shadow bar,
ROLLED_BACK on a probation figure over its bar or a failed load). The platform in ``up/info`` is a
plausible Orin's; the frame-path telemetry (fps, latencies, CPU, temperatures) is drawn at random
around plausible values. The slots' models live in the worker's memory, not in ``state.json``.

The flags are in :mod:`agent.fleetsim.plan` and :mod:`agent.fleetsim.launcher`, and in
docs/fleet.md, "Fleet simulator". Nothing in ``agent/`` imports this package (it is a composition
root, like :mod:`agent.app.root`).
"""
