"""Each device's configuration and agent release as ``fleet status`` and the console keep and show them."""

from __future__ import annotations

from agent.fleet.base.bounded import cost
from agent.fleet.view.targets import TARGETS_BYTES, target_cell, target_notes, target_summary
from agent.protocol.device_targets import TargetInfo
from agent.protocol.messages import InfoMessage


def _info(config: TargetInfo | None, agent: TargetInfo | None) -> InfoMessage:
    return InfoMessage(
        device_id="jet-1", agent_version="0.3.1", platform={}, labels={}, backends={}, slots={}, streams=[],
        config=config, agent_release=agent,
    )  # fmt: skip


def test_what_runs_what_is_pending_and_what_was_put_back_read_in_one_cell() -> None:
    summary = target_summary(
        _info(
            TargetInfo(version="cfg-6", pending="cfg-7"),
            TargetInfo(version="0.3.1", reverted="agent_reverted: x"),
        )
    )
    assert target_cell("config", summary["config"]) == "cfg-6 -> cfg-7"
    assert target_cell("agent", summary["agent"]) == "0.3.1 (reverted)"
    assert target_notes(summary) == ["agent put back: agent_reverted: x"]
    assert target_cell("config", target_summary(_info(TargetInfo(), None))["config"]) == "base"
    assert target_summary(_info(None, None)) == {}  # an older agent reports neither


def test_a_devices_longest_targets_are_kept_within_the_bound_and_printed_escaped() -> None:
    hostile = "\x1b[2J" + "v" * 60
    longest = TargetInfo(version=hostile, job_id="j" * 128, pending="p" * 64, reverted="\u202e" + "r" * 299)
    summary = target_summary(_info(longest, longest))
    assert cost(summary) <= TARGETS_BYTES
    assert summary["config"]["reverted"] == longest.reverted  # whole: within the bound
    cell = target_cell("config", summary["config"])
    assert "\x1b" not in cell
    assert "\u202e" not in target_notes(summary)[0]
