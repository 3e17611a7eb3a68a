"""The self-test's reports: one JSON document and the same as a Markdown page, each written atomically.

The JSON is for machines (a fleet collecting reports from many devices); the Markdown is what an
operator attaches to a ticket. Both list every step with its status, the line's text (the detail of a
pass, the reason of a skip or failure), its time against its budget, and what a pass proves.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent.fsutil import atomic_write_json, atomic_write_text
from agent.selftest.step import StepResult

MARK = {"pass": "PASS", "fail": "FAIL", "skip": "SKIP"}


def summary(results: Sequence[StepResult]) -> dict[str, int]:
    """How many steps passed, failed and were skipped."""
    counts = {"pass": 0, "fail": 0, "skip": 0}
    for result in results:
        counts[result.status] += 1
    return counts


def report_document(results: Sequence[StepResult], header: dict[str, Any]) -> dict[str, Any]:
    """The JSON report: ``header`` (version, platform, options, times), the counts, every step."""
    counts = summary(results)
    return {
        **header,
        "ok": counts["fail"] == 0,
        "summary": counts,
        "budget_total_s": sum(r.budget_s for r in results),
        "steps": [r.as_dict() for r in results],
    }


def step_line(result: StepResult) -> str:
    """One console line: ``PASS  build.cpu.fp16  1.2 s / 15 s  detail``."""
    over = " OVER BUDGET" if result.over_budget else ""
    timing = f"{result.seconds:6.1f} s / {result.budget_s:.0f} s{over}"
    return f"{MARK[result.status]}  {result.name:<26} {timing}  {result.detail}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(document: dict[str, Any]) -> str:
    """The Markdown page of a JSON report."""
    counts = document["summary"]
    verdict = "passed" if document["ok"] else "FAILED"
    lines = [
        f"# edge-agent self-test: {verdict}",
        "",
        f"- agent {document.get('agent_version')}, {'quick' if document.get('quick') else 'full'} run, "
        f"started {document.get('started')}, {document.get('seconds', 0):.1f} s "
        f"(budget on an AGX Orin {document['budget_total_s']:.0f} s)",
        f"- {counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped",
        f"- machine: {_cell(str(document.get('machine', '')))}",
        "",
        "| step | result | seconds / budget | detail or reason | a pass proves |",
        "|---|---|---|---|---|",
    ]
    for step in document["steps"]:
        over = " (over budget)" if step["over_budget"] else ""
        lines.append(
            f"| `{step['name']}` | {MARK[step['status']]} "
            f"| {step['seconds']:.1f} / {step['budget_s']:.0f}{over} "
            f"| {_cell(step['detail'])} | {_cell(step['proves'])} |"
        )
    return "\n".join(lines) + "\n"


def write_reports(document: dict[str, Any], json_path: Path) -> Path:
    """Write the JSON to ``json_path`` and the Markdown beside it (``.md``); return the Markdown path."""
    md_path = json_path.with_suffix(".md")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(json_path, document, default=str)
    atomic_write_text(md_path, markdown(document))
    return md_path
