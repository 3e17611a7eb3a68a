"""The pydantic base every configuration and protocol model derives from."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Unknown keys are errors (a typo in YAML must not be silently ignored); instances are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)
