"""The controller's engine store: the second level of every device's engine cache (docs/engines.md).

``settings`` (the ``engines:`` block of controller.yaml), ``trust`` (the pure decisions: who may
offer, when sharing is on, what a drop withdraws, signing), ``store`` (bounded, LRU, on disk),
``desk`` (the devices' ``up/engines/{verb}`` requests, answered on their own thread),
``listing`` (``fleet engines list``'s text), ``local`` (the desk without a broker: selftest, tests)
and ``hooks`` (what the controller process calls). Nothing here imports the controller process,
its config or the CLI: they import this (the upload sink is handed in).
"""
