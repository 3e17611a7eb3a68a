"""Raw YAML data walked along the configuration models' types, before pydantic validates it.

Used by loading (empty sections, relative paths) and by the error text (which key path the operator
wrote), so both agree on how a key maps to a field, a ``dict`` item or a discriminated union member.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, TypeGuard, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo


def unwrap(tp: Any) -> tuple[Any, str | None]:
    """Strip ``Annotated`` and ``| None`` from a type; return it and its discriminator, if any."""
    discriminator: str | None = None
    while True:
        if get_origin(tp) is Annotated:
            for meta in get_args(tp)[1:]:
                if isinstance(meta, FieldInfo) and isinstance(meta.discriminator, str):
                    discriminator = meta.discriminator
            tp = get_args(tp)[0]
            continue
        if get_origin(tp) in (Union, UnionType):
            members = [m for m in get_args(tp) if m is not type(None)]
            if len(members) == 1:
                tp = members[0]
                continue
        return tp, discriminator


def field_type(model: type[BaseModel], key: Any) -> tuple[Any, str | None] | None:
    """The unwrapped type and discriminator of ``model``'s field ``key``; None when it has none."""
    field = model.model_fields.get(key) if isinstance(key, str) else None
    if field is None:
        return None
    tp, discriminator = unwrap(field.annotation)
    if isinstance(field.discriminator, str):
        discriminator = field.discriminator
    return tp, discriminator


def is_model(tp: Any) -> TypeGuard[type[BaseModel]]:
    """Whether ``tp`` is a pydantic model class."""
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def union_members(tp: Any, discriminator: str) -> dict[Any, type[BaseModel]]:
    """Map each tag value of a discriminated union to its member model."""
    members: dict[Any, type[BaseModel]] = {}
    for member in get_args(tp):
        if is_model(member) and discriminator in member.model_fields:
            for tag in get_args(member.model_fields[discriminator].annotation):
                members[tag] = member
    return members


def descend(tp: Any, discriminator: str | None, value: Any) -> Any:
    """The model type a raw ``value`` of annotation ``tp`` validates as (picks union members)."""
    if discriminator and isinstance(value, dict):
        return union_members(tp, discriminator).get(value.get(discriminator))
    return tp


def drop_empty_sections(data: dict[str, Any], model: type[BaseModel]) -> None:
    """Treat ``section:`` with nothing below it (YAML null) as absent, so its defaults apply."""
    for key in list(data):
        found = field_type(model, key)
        if found is None:
            continue
        tp, _ = found
        field = model.model_fields[key]
        value = data[key]
        if value is None and not field.is_required() and not _admits_none(field.annotation):
            del data[key]
        elif is_model(tp) and isinstance(value, dict):
            drop_empty_sections(value, tp)
        elif get_origin(tp) is dict and isinstance(value, dict):
            item_tp, _ = unwrap(get_args(tp)[1])
            for item in value.values():
                if is_model(item_tp) and isinstance(item, dict):
                    drop_empty_sections(item, item_tp)


def _admits_none(annotation: Any) -> bool:
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return get_origin(annotation) in (Union, UnionType) and type(None) in get_args(annotation)


def resolve_paths(value: Any, tp: Any, base_dir: Path, discriminator: str | None = None) -> Any:
    """Return raw ``value`` with every relative string in a ``Path`` field made absolute."""
    tp = descend(tp, discriminator, value)
    if tp is Path:
        if isinstance(value, str) and value and not Path(value).is_absolute():
            # Lexically normalised (``configs/../agent/x`` -> ``agent/x``): the path as an operator
            # reads it from the file's directory, which is what logs and state.json then show. Not
            # resolved: symlinks stay as named, like base_dir's.
            return os.path.normpath(base_dir / value)
        return value
    if is_model(tp) and isinstance(value, dict):
        out = {}
        for key, item in value.items():
            found = field_type(tp, key)
            out[key] = item if found is None else resolve_paths(item, found[0], base_dir, found[1])
        return out
    if get_origin(tp) is dict and isinstance(value, dict):
        item_tp, item_disc = unwrap(get_args(tp)[1])
        return {k: resolve_paths(v, item_tp, base_dir, item_disc) for k, v in value.items()}
    if get_origin(tp) is list and isinstance(value, list):
        item_tp, item_disc = unwrap(get_args(tp)[0])
        return [resolve_paths(v, item_tp, base_dir, item_disc) for v in value]
    return value
