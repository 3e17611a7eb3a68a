"""docs/protocol.md's agent release example is a document the device reads, and its codes are the device's."""

from __future__ import annotations

import re
from pathlib import Path

from agent.protocol.delivery_errors import AgentIncompatibleError, AgentInstallFailedError
from agent.protocol.device_targets import AgentRelease

DOCS = Path(__file__).resolve().parents[3] / "docs"


def _section() -> str:
    text = (DOCS / "protocol.md").read_text()
    match = re.search(r"^### The agent release \(`_agent`\)\n(.*?)(?=^##)", text, re.S | re.M)
    assert match, "docs/protocol.md has no agent release section"
    return match.group(1)


def test_the_documented_release_is_one_the_device_reads() -> None:
    [example] = re.findall(r"```json\n(.*?)```", _section(), re.S)
    release = AgentRelease.model_validate_json(example)
    assert release.distribution == "edge-agent"
    assert [w.filename.split("-")[0] for w in release.wheels] == ["edge_agent", "onnxruntime_gpu"]


def test_the_documented_codes_are_the_devices() -> None:
    section = _section()
    for code in (AgentIncompatibleError.code, AgentInstallFailedError.code, "agent_reverted"):
        assert f"`{code}`" in section
        assert f"`{code}`" in (DOCS / "agent-updates.md").read_text()
