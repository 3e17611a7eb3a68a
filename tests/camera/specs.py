"""Building source specs in tests."""

from __future__ import annotations

from typing import Any, TypeVar

from agent.model_base import StrictModel

M = TypeVar("M", bound=StrictModel)


def make(cls: type[M], **fields: Any) -> M:
    """``cls(**fields)`` through validation.

    mypy without the pydantic plugin does not see defaults given positionally to ``Field`` and
    would flag every omitted field of a direct constructor call.
    """
    return cls.model_validate(fields)
