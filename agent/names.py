"""Names the agent turns into MQTT topic levels and file names: device ids, slots, streams.

At the ground floor (docs/architecture.md) so the configuration models and the delivery manifest
check names by the same rule and explain a bad one with the same words.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field

#: Device ids, slot and stream names become MQTT topic levels and file names.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

#: A string field that must match :data:`NAME_PATTERN`.
Name = Annotated[str, Field(pattern=NAME_PATTERN.pattern)]

#: What a bad name is told to look like.
NAME_RULE = "use 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit"
