"""The agent's configuration: pydantic models, loaded from YAML with environment overrides.

The ground floor of the house (docs/architecture.md): nothing here imports the agent above names,
errors, the pydantic base and each package's own settings/spec model. The package holds one job per
module: :mod:`~agent.config.models` (the file's shape), :mod:`~agent.config.loading` (YAML,
environment, relative paths, files that must exist), :mod:`~agent.config.problems` (the operator's
error text), :mod:`~agent.config.walk` (raw data along the models' types) and
:mod:`~agent.config.changes` (what a reload changed, secrets hidden). The names below are the
public entry point, so ``from agent.config import AgentConfig, load_config`` keeps working;
docs/configuration.md describes the file for operators.
"""

from __future__ import annotations

from agent.config.loading import ENV_PREFIX, ENV_SEPARATOR, base_dir, check_config, load_config, read_yaml
from agent.config.models import AgentConfig, LoggingConfig, SlotConfig, StreamConfig, TelemetryConfig
from agent.config.walk import resolve_paths
from agent.names import NAME_PATTERN, Name
from agent.secret_file import read_secret

__all__ = [
    "ENV_PREFIX",
    "ENV_SEPARATOR",
    "NAME_PATTERN",
    "AgentConfig",
    "LoggingConfig",
    "Name",
    "SlotConfig",
    "StreamConfig",
    "TelemetryConfig",
    "base_dir",
    "check_config",
    "load_config",
    "read_secret",
    "read_yaml",
    "resolve_paths",
]
