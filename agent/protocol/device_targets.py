"""The device's own configuration and its agent release as desired state: two targets beside the slots.

A desired state for a target travels like a model's (docs/protocol.md, "The device's own targets"):
the same signed envelope on ``down/desired/{target}``, retained, the same job statuses on
``up/jobs/{job_id}``, the same release check when the device has a fleet root, the same rollouts in
waves. Only what the "model" bytes are, and how they are applied, differ:

* ``_config``: the bytes are a YAML *overlay* over the device's own agent.yaml (:data:`OVERLAY_KEYS`
  only; identity, broker and trust settings stay the installer's), validated like ``check-config``
  before anything changes, applied, watched for a probation window, and put back by the device when
  it is not healthy (``config_reverted``).
* ``_agent``: the bytes are an :class:`AgentRelease` (the wheels by name, size and SHA-256); each wheel
  is a manifest artifact of kind ``wheel``, and a device fetches only the wheels it does not hold.
  Installed side by side, started, confirmed when healthy, otherwise the previous release runs again
  (``agent_reverted``).

Target names start with ``_``, which no slot name can (:data:`agent.names.NAME_PATTERN`), so a target
and a slot never share a topic.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from agent.model_base import StrictModel

CONFIG_TARGET = "_config"
AGENT_TARGET = "_agent"
DEVICE_TARGETS = frozenset({CONFIG_TARGET, AGENT_TARGET})

#: What a desired state's bytes are: a model for a slot, or one of the device's own targets.
TargetKind = Literal["model", "config", "agent"]

#: Top-level agent.yaml keys a configuration overlay may set. Left out on purpose: ``device_id`` and
#: ``state_dir`` (who the device is, where its record of this overlay lives), ``mqtt`` and
#: ``enrollment`` (a wrong broker or certificate path cuts the device off the channel that would fix
#: it), ``spool``; and under ``delivery`` the keys that decide whom the device trusts
#: (:data:`OVERLAY_DENIED_KEYS`): trust changes only through the signed fleet root.
OVERLAY_KEYS = frozenset(
    {"labels", "slots", "streams", "telemetry", "logging", "snapshot", "watchdog", "delivery", "engines"}
)
#: Dotted keys under :data:`OVERLAY_KEYS` an overlay may not set.
OVERLAY_DENIED_KEYS = frozenset(
    {"delivery.enabled", "delivery.trusted_keys", "delivery.require_signature", "delivery.trust_root"}
)

#: Largest configuration overlay, bytes (a few hundred lines of YAML).
MAX_OVERLAY_BYTES = 256 * 1024
#: Most wheels one agent release names (the agent and its dependencies).
MAX_RELEASE_WHEELS = 128
#: Largest agent release document, bytes.
MAX_AGENT_RELEASE_BYTES = 64 * 1024

#: A wheel's file name (PEP 427): name-version(-build)?-python-abi-platform.whl, one path level.
WHEEL_FILENAME = re.compile(
    r"^(?P<name>[A-Za-z0-9_.]+)-(?P<version>[A-Za-z0-9_.+!]+)(-\d[A-Za-z0-9_]*)?-(?P<python>[A-Za-z0-9_.]+)"
    r"-(?P<abi>[A-Za-z0-9_.]+)-(?P<platform>[A-Za-z0-9_.]+)\.whl$"
)


def target_kind(slot: str) -> TargetKind:
    """What the desired state of ``slot`` (a slot name or a target) carries."""
    if slot == CONFIG_TARGET:
        return "config"
    if slot == AGENT_TARGET:
        return "agent"
    return "model"


class AgentWheel(StrictModel):
    """One wheel of an agent release: the file pip installs, named as pip needs it."""

    filename: str = Field(max_length=200, description="The wheel's file name (PEP 427).")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 (lowercase hex) of the file.")
    size: int = Field(gt=0, description="File size in bytes.")

    @field_validator("filename")
    @classmethod
    def _wheel_name(cls, value: str) -> str:
        if not WHEEL_FILENAME.match(value):
            raise ValueError(f"{value!r} is not a wheel file name (name-version-python-abi-platform.whl)")
        return value


class AgentRelease(StrictModel):
    """The bytes of an ``_agent`` desired state: one agent version and every wheel it runs from.

    ``python`` and ``platforms`` let a device refuse a release it cannot run before it touches
    anything (``agent_incompatible``); the wheels' tags are checked too.
    """

    format: Literal[1] = 1
    version: str = Field(
        pattern=r"^[0-9][A-Za-z0-9.+!_-]{0,63}$", description="The agent's version (PEP 440)."
    )
    python: str = Field(
        pattern=r"^3\.[0-9]{1,2}$", description="The Python minor version the wheels are for, e.g. 3.10."
    )
    platforms: list[str] = Field(
        min_length=1,
        max_length=8,
        description="Machine names (platform.machine(): aarch64, x86_64) the release runs on.",
    )
    wheels: list[AgentWheel] = Field(min_length=1, max_length=MAX_RELEASE_WHEELS)
    #: The distribution whose console script is the agent (``edge-agent``).
    distribution: str = Field("edge-agent", pattern=r"^[A-Za-z0-9_.-]{1,64}$")


class TargetInfo(StrictModel):
    """What ``up/info`` says of one of the device's own targets: what runs, and what is on its way."""

    version: str | None = Field(
        None, max_length=64, description="What runs: the overlay's version (none: no overlay) or the release."
    )
    job_id: str | None = Field(None, max_length=128, description="The job that put it in place, if any.")
    pending: str | None = Field(
        None, max_length=64, description="The version being applied or watched (PROBATION), if any."
    )
    reverted: str | None = Field(
        None,
        max_length=300,
        description="Why the last version that was tried was put back (config_reverted, agent_reverted).",
    )
