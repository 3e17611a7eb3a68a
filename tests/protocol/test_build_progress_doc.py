"""docs/protocol.md's inline examples of build progress are what the message models accept."""

from __future__ import annotations

import json
import re
from pathlib import Path

from agent.protocol.messages import BuildProgressInfo, SlotInfo

DOC = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()


def _inline(prefix: str) -> dict[str, object]:
    """The ``{...}`` after ``prefix`` in the doc (its backquoted lines joined)."""
    start = DOC.index(prefix)
    end = DOC.index("}`", start) + 1
    text = DOC[start:end].replace("`\n`", " ").replace("\n", " ")
    parsed: dict[str, object] = json.loads("{" + text + "}")
    return parsed


def test_the_up_info_example_of_a_start_up_build_is_a_valid_slot() -> None:
    fields = _inline('"serving": "interim", "building"')
    slot = SlotInfo.model_validate({"state": "active", **fields})
    assert slot.serving == "interim"
    assert slot.building is not None
    assert slot.building.phase == "calibrating"


def test_the_job_status_example_of_build_progress_is_valid() -> None:
    fields = _inline('"build": {"phase": "building"')
    build = BuildProgressInfo.model_validate(fields["build"])
    assert (build.phase, build.estimate_s) == ("building", 310.0)
    assert re.search(r"at\s+most one per 2 s", DOC)
