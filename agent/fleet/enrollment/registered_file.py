"""The file of devices admitted at once (``enrollment.registered_file`` in controller.yaml).

A YAML mapping whose ``devices`` lists entries; each names a device id, a hardware serial, or both
(then the request must name that serial)::

    devices:
      - {id: cam-entrance-01, serial: "1423021000123"}
      - {serial: "1423021000124"}
      - {id: cam-dock-02}
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, ValidationError, model_validator

from agent.config import read_yaml
from agent.errors import ConfigError
from agent.model_base import StrictModel
from agent.names import Name


class RegisteredDevice(StrictModel):
    """One entry: a device id, a serial, or both."""

    id: Name | None = Field(None, description="The device id admitted at once.")
    serial: str | None = Field(None, min_length=1, max_length=128, description="Its hardware serial.")

    @model_validator(mode="after")
    def _either(self) -> RegisteredDevice:
        if self.id is None and self.serial is None:
            raise ValueError("give an id, a serial, or both")
        return self


class RegisteredFile(StrictModel):
    """The file's content."""

    devices: list[RegisteredDevice] = Field(default_factory=list, max_length=1_000_000)


def read_registered_file(path: Path) -> list[tuple[str | None, str | None]]:
    """(device id, serial) of each entry of ``path`` (ConfigError naming the entry that is wrong)."""
    try:
        content = RegisteredFile.model_validate(read_yaml(path, allow_empty=True))
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"{path}: {problems}") from exc
    return [(entry.id, entry.serial) for entry in content.devices]
