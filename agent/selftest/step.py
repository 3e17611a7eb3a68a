"""A self-test step: a name, a time budget, what a pass proves, and a function that runs it.

The function returns a :class:`Passed` (a one-line detail and the figures), or raises
:class:`Skipped` with the reason, or raises anything else, which is a failure with that message:
a broken step never stops the steps after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

import structlog

from agent.errors import AgentError

log = structlog.get_logger(__name__)

Status = Literal["pass", "fail", "skip"]
C = TypeVar("C")


class Skipped(Exception):  # noqa: N818 - an outcome, not an error: a step that cannot run here
    """The step cannot run on this machine; the message is the reason shown on its line."""


class StepFailure(AgentError):  # noqa: N818 - reads as the outcome of a step, like Skipped
    """The step ran and what it checks did not hold; ``data`` keeps the figures it measured."""

    def __init__(self, message: str, data: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.data = data or {}


@dataclass(frozen=True)
class Passed:
    """A passing step's one-line detail and its figures."""

    detail: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Step(Generic[C]):
    """One named check with its budget (seconds on an AGX Orin) and what a pass proves."""

    name: str
    budget_s: float
    proves: str
    run: Callable[[C], Passed]


@dataclass(frozen=True)
class StepResult:
    """What one step did: status, the line's text (detail or reason), time taken against its budget."""

    name: str
    status: Status
    detail: str
    seconds: float
    budget_s: float
    proves: str
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def over_budget(self) -> bool:
        """Took longer than its budget (reported, not a failure: budgets are for an Orin)."""
        return self.seconds > self.budget_s

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form, one entry of the report's ``steps``."""
        return {
            "name": self.name,
            "status": self.status,
            "detail": self.detail,
            "seconds": round(self.seconds, 3),
            "budget_s": self.budget_s,
            "over_budget": self.over_budget,
            "proves": self.proves,
            "data": self.data,
        }


def run_step(step: Step[C], context: C) -> StepResult:
    """Run one step; a skip or any exception becomes its result, never escapes."""
    started = time.monotonic()
    status: Status
    data: dict[str, Any] = {}
    try:
        passed = step.run(context)
    except Skipped as exc:
        status, detail = "skip", str(exc)
    except StepFailure as exc:
        status, detail, data = "fail", str(exc), exc.data
    except AgentError as exc:
        status, detail = "fail", str(exc)
    except Exception as exc:
        log.exception("selftest.step.crashed", step=step.name)
        status, detail = "fail", f"{type(exc).__name__}: {exc}"
    else:
        status, detail, data = "pass", passed.detail, passed.data
    seconds = time.monotonic() - started
    return StepResult(step.name, status, detail, seconds, step.budget_s, step.proves, data)


def run_steps(
    steps: Sequence[Step[C]], context: C, on_result: Callable[[StepResult], None] | None = None
) -> list[StepResult]:
    """Run every step in order; ``on_result`` sees each result as soon as it is known."""
    results = []
    for step in steps:
        result = run_step(step, context)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results
