"""Names the agent turns into MQTT topic levels and file names: device ids, slots, streams.

At the ground floor (docs/architecture.md) so the configuration models and the delivery manifest
check names by the same rule and explain a bad one with the same words.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field

#: Device ids, slot and stream names become MQTT topic levels and file names.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

#: A string field that must match :data:`NAME_PATTERN`.
Name = Annotated[str, Field(pattern=NAME_PATTERN.pattern)]

#: What a bad name is told to look like.
NAME_RULE = "use 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit"


# -- device labels (Kubernetes rules) ---------------------------------------------------------------

#: A label name, and a label value when not empty: Kubernetes' rule (1-63 characters, letters,
#: digits, '-', '_', '.', starting and ending with a letter or digit), so selectors read as the
#: operators of a Kubernetes cluster expect them to.
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$")
#: A label key's optional prefix: a DNS subdomain (``example.com/site``), at most 253 characters.
_LABEL_PREFIX = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$")
#: Key prefixes that name what the device reports about itself (``platform.dla_cores``,
#: ``agent.version``) in a selector; a label may not take them, so a selector is never ambiguous.
RESERVED_LABEL_PREFIXES = ("platform.", "agent.")


def label_key_problem(key: str) -> str | None:
    """What is wrong with ``key`` as a device label key (None: nothing)."""
    if key.startswith(RESERVED_LABEL_PREFIXES):
        return f"label key {key!r}: keys starting with 'platform.' or 'agent.' name device facts in selectors"
    prefix, slash, name = key.rpartition("/")
    if slash and not (0 < len(prefix) <= 253 and _LABEL_PREFIX.match(prefix)):
        return f"label key {key!r}: the prefix before '/' must be a DNS subdomain (lower case, at most 253)"
    if not _LABEL_NAME.match(name):
        return (
            f"label key {key!r}: use 1-63 letters, digits, '-', '_' or '.', starting and ending with "
            "a letter or digit (optionally after a DNS prefix and '/')"
        )
    return None


def label_value_problem(value: str) -> str | None:
    """What is wrong with ``value`` as a device label value (None: nothing; empty is allowed)."""
    if value and not _LABEL_NAME.match(value):
        return (
            f"label value {value!r}: use at most 63 letters, digits, '-', '_' or '.', starting and "
            "ending with a letter or digit"
        )
    return None


def _check_key(key: str) -> str:
    problem = label_key_problem(key)
    if problem:
        raise ValueError(problem)
    return key


def _check_value(value: str) -> str:
    problem = label_value_problem(value)
    if problem:
        raise ValueError(problem)
    return value


#: A device label key and value, checked by :func:`label_key_problem` and :func:`label_value_problem`.
LabelKey = Annotated[str, AfterValidator(_check_key)]
LabelValue = Annotated[str, AfterValidator(_check_value)]
