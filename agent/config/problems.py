"""The operator's error text: pydantic errors phrased at the key path the operator wrote.

One :class:`Problem` per error, rendered ``key.path: what is wrong``; :func:`config_error` gathers
them into the one :class:`~agent.errors.ConfigError` that ``check-config`` prints.
"""

from __future__ import annotations

import difflib
from datetime import date
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic_core import ErrorDetails

from agent.config.models import AgentConfig
from agent.config.walk import field_type, is_model, union_members, unwrap
from agent.errors import ConfigError
from agent.names import NAME_PATTERN, NAME_RULE


class Problem:
    """One problem: the key path (tuple of keys and list indexes) and what is wrong there."""

    __slots__ = ("loc", "what")

    def __init__(self, loc: tuple[str | int, ...], what: str) -> None:
        self.loc = loc
        self.what = what

    def render(self) -> str:
        """``key.path[0].sub: what is wrong``, as the operator wrote the keys."""
        if not self.loc:
            return self.what
        path = ""
        for part in self.loc:
            path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
        return f"{path}: {self.what}"


def clean_loc(loc: tuple[str | int, ...]) -> tuple[tuple[str | int, ...], list[Any]]:
    """Drop the tag levels pydantic inserts for discriminated unions and ``[key]`` markers.

    Returns the path as the operator wrote it and the annotation at each level of it
    (``types[i]`` is the type of ``path[:i]``; ``None`` where unknown).
    """
    path: list[str | int] = []
    types: list[Any] = [AgentConfig]
    tp: Any = AgentConfig
    disc: str | None = None
    i = 0
    while i < len(loc):
        seg = loc[i]
        if seg == "[key]":
            i += 1
            continue
        if disc is not None:
            member = union_members(tp, disc).get(seg)
            if member is not None:  # a union tag level: not a key the operator wrote
                tp, disc = member, None
                types[-1] = member
                i += 1
                continue
        path.append(seg)
        if is_model(tp):
            found = field_type(tp, seg)
            tp, disc = found if found is not None else (None, None)
        elif get_origin(tp) is dict:
            tp, disc = unwrap(get_args(tp)[1])
        elif get_origin(tp) in (list, tuple) and isinstance(seg, int):
            args = [a for a in get_args(tp) if a is not Ellipsis]
            item = args[seg] if get_origin(tp) is tuple and seg < len(args) else args[0] if args else None
            tp, disc = unwrap(item)
        else:
            tp, disc = None, None
        types.append(tp)
        i += 1
    return tuple(path), types


def describe(error: ErrorDetails) -> Problem:
    """Phrase one pydantic error for an operator, at the key path the operator wrote."""
    loc, types = clean_loc(tuple(error["loc"]))
    kind = error["type"]
    ctx: dict[str, Any] = dict(error.get("ctx") or {})
    value = error.get("input")
    here = types[-1]

    if kind in ("union_tag_invalid", "union_tag_not_found"):
        disc = str(ctx.get("discriminator", "type")).strip("'")
        tags = ", ".join(str(t) for t in union_members(here, disc)) or ctx.get("expected_tags", "")
        if kind == "union_tag_not_found":
            return Problem((*loc, disc), f"required key is missing (one of {tags})")
        return Problem((*loc, disc), f"{ctx.get('tag')!r} is not one of {tags}")
    if kind == "missing" and len(loc) >= 2 and get_origin(types[-2]) is tuple:
        size = len(get_args(types[-2]))  # pydantic reports each absent tuple item separately
        return Problem(loc[:-1], f"must be a list of {size} values")
    if kind == "literal_error":
        choices = get_args(here) if get_origin(here) is Literal else ()
        allowed = ", ".join(str(c) for c in choices) if choices else str(ctx.get("expected"))
        return Problem(loc, f"{value!r} is not one of {allowed}")
    if kind == "extra_forbidden":
        parent = types[-2] if len(types) >= 2 else None
        what = "unknown key"
        if is_model(parent):
            close = difflib.get_close_matches(str(loc[-1]), list(parent.model_fields), n=1)
            if close:
                what += f" (did you mean {close[0]!r}?)"
            else:
                what += f" (allowed: {', '.join(parent.model_fields)})"
        return Problem(loc, what)
    if kind == "string_pattern_mismatch" and ctx.get("pattern") == NAME_PATTERN.pattern:
        return Problem(
            loc,
            f"{value!r} is not a valid name: {NAME_RULE}",
        )
    if kind == "value_error" and isinstance(ctx.get("error"), Exception):
        return Problem(loc, str(ctx["error"]))
    if value is None and kind not in ("missing",) and kind.endswith("_type"):
        return Problem(loc, "must have a value (it is empty)")
    template = _MESSAGES.get(kind)
    if template is not None:
        what = template.format(value=describe_value(value), **ctx)
        if kind == "string_type" and isinstance(value, (int, float, bool, date)):
            what += " (put it in quotes)"
        return Problem(loc, what)
    return Problem(loc, error["msg"].replace("Input should be", "must be"))


_MESSAGES = {
    "missing": "required key is missing",
    "greater_than": "must be greater than {gt}",
    "greater_than_equal": "must be greater than or equal to {ge}",
    "less_than": "must be less than {lt}",
    "less_than_equal": "must be less than or equal to {le}",
    "string_type": "must be a string, not {value}",
    "int_type": "must be an integer, not {value}",
    "int_parsing": "must be an integer, not {value}",
    "int_from_float": "must be a whole number, not {value}",
    "float_type": "must be a number, not {value}",
    "float_parsing": "must be a number, not {value}",
    "bool_type": "must be true or false, not {value}",
    "bool_parsing": "must be true or false, not {value}",
    "path_type": "must be a file path, not {value}",
    "list_type": "must be a list, not {value}",
    "tuple_type": "must be a list, not {value}",
    "dict_type": "must be a mapping of keys, not {value}",
    "model_type": "must be a mapping of keys, not {value}",
    "model_attributes_type": "must be a mapping of keys, not {value}",
    "too_short": "must have at least {min_length} items, not {actual_length}",
    "too_long": "must have at most {max_length} items, not {actual_length}",
}


def describe_value(value: Any) -> str:
    """A value as an error message names it: ``empty``, ``a mapping``, ``a list`` or its repr."""
    if value is None:
        return "empty"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return repr(value) if not isinstance(value, date) else repr(str(value))


def config_error(path: Path, problems: list[Problem], env_keys: dict[tuple[str, ...], str]) -> ConfigError:
    """One ConfigError listing every problem once, sorted, each naming the variable that set it."""
    lines: list[str] = []
    for problem in problems:
        line = problem.render()
        for keys, variable in env_keys.items():
            if tuple(str(p) for p in problem.loc[: len(keys)]) == keys:
                line += f" (set by environment variable {variable})"
                break
        if line not in lines:
            lines.append(line)
    lines.sort()
    count = f"{len(lines)} problem" + ("s" if len(lines) != 1 else "")
    message = f"invalid configuration {path} ({count}):\n" + "\n".join(f"  {line}" for line in lines)
    return ConfigError(message, problems=lines)
