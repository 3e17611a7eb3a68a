"""``edge-agent selftest``: prove, step by step on the machine it runs on, what the agent can do there.

Each step (:mod:`agent.selftest.step`) has a name, a time budget and one line saying what a pass
proves; it passes, fails, or is skipped with the reason. :mod:`agent.selftest.targets` decides (pure)
which devices this platform can build for; :mod:`agent.selftest.steps` lists the steps, which live
in ``device_steps``, ``engine_steps`` and ``runtime_steps`` and share ``run``;
:mod:`agent.selftest.report` writes the JSON and Markdown reports. docs/selftest.md is the operator's
guide.
"""
