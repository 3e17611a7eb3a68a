"""Loading the configuration: YAML, environment overrides, relative paths, files that must exist.

:func:`load_config` is the one way the agent (and ``check-config``) reads its file;
:func:`read_yaml` and :func:`resolve_paths` are the one YAML reader and relative-path rule, shared
with the operator tools that read an agent-style file's ``mqtt:`` section.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from agent.config.models import AgentConfig, unknown_slot_what
from agent.config.overlay import merge_overlay
from agent.config.problems import Problem, config_error, describe, describe_value
from agent.config.walk import drop_empty_sections, resolve_paths
from agent.errors import ConfigError

#: Environment variables with this prefix override configuration keys, e.g.
#: ``EDGE_AGENT__MQTT__PORT=1884`` sets ``mqtt.port``.
ENV_PREFIX = "EDGE_AGENT__"
ENV_SEPARATOR = "__"


def load_config(
    path: Path,
    environ: Mapping[str, str] | None = None,
    *,
    require_models: bool = True,
    overlay: Mapping[str, Any] | None = None,
) -> AgentConfig:
    """Load and validate the configuration file at ``path``, applying environment overrides.

    ``environ`` defaults to ``os.environ``; only ``EDGE_AGENT__*`` variables are used. Relative paths
    are resolved against the directory of ``path``. Files the agent needs at start (slot models,
    label files, the MQTT password file, TLS files) must exist. Every problem found is reported in
    one :class:`~agent.errors.ConfigError` whose ``problems`` read ``key.path: what is wrong``.

    The daemon passes ``require_models=False``: a missing model file must not keep a device from
    starting (it falls back to the last model that worked, from ``state.json``) nor make a reload
    fail as a whole (that slot's swap is rejected and the old model keeps serving).

    ``overlay`` (a configuration overlay delivered as desired state) is merged over the file before
    the environment (:func:`~agent.config.overlay.merge_overlay`); its relative paths are the file's.
    """
    path = Path(path)
    data = read_yaml(path)
    if overlay:
        data = merge_overlay(data, overlay)
    env_keys = _apply_environment(data, os.environ if environ is None else environ)
    drop_empty_sections(data, AgentConfig)
    directory = base_dir(path)
    data = resolve_paths(data, AgentConfig, directory)

    problems: list[Problem] = []
    config: AgentConfig | None = None
    try:
        config = AgentConfig.model_validate(data)
    except ValidationError as exc:
        problems.extend(describe(error) for error in exc.errors())
    problems.extend(_missing_files(data, directory, require_models=require_models))
    problems.extend(_unknown_slots(data))
    if problems or config is None:
        raise config_error(path, problems, env_keys)
    return config


def check_config(path: Path, environ: Mapping[str, str] | None = None) -> list[str]:
    """Return every problem in the configuration at ``path`` (an empty list when it is valid)."""
    try:
        load_config(path, environ)
    except ConfigError as exc:
        return list(exc.problems)
    return []


class _StrictLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses duplicate keys, which YAML would resolve silently (last wins)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: dict[Any, yaml.Mark] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # keys written next to a `<<: *anchor` merge legitimately override merged ones
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.get(key)
        except TypeError:  # an unhashable key: construct_mapping reports it below
            continue
        if first is not None:
            raise yaml.constructor.ConstructorError(
                "while reading a mapping",
                node.start_mark,
                f"duplicate key {key!r} (first at line {first.line + 1})",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def base_dir(path: Path) -> Path:
    """The directory that relative paths in the YAML file at ``path`` are taken from: the file's own.

    The path is made absolute without resolving symlinks, so a config linked into place names files
    next to the link, as an operator reading the link's directory expects.
    """
    return Path(path).absolute().parent


def read_yaml(path: Path, *, allow_empty: bool = False) -> dict[str, Any]:
    """The mapping in the YAML file at ``path``; ConfigError naming the file, line and column.

    Duplicate keys are errors. An empty file is one too, unless ``allow_empty`` (then ``{}``).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise _file_error(path, "file not found; pass the path of the agent's YAML configuration") from exc
    except OSError as exc:
        raise _file_error(path, f"cannot read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise _file_error(path, f"not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 -- a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        what = ": ".join(part for part in (exc.context, exc.problem) if part)
        raise _file_error(path, f"YAML syntax error at {where}: {what}") from exc
    except yaml.YAMLError as exc:
        raise _file_error(path, f"YAML error: {exc}") from exc
    if data is None and allow_empty:
        return {}
    if data is None:
        raise _file_error(path, "the file is empty; it must be a mapping with at least device_id")
    if not isinstance(data, dict):
        raise _file_error(path, f"the top level must be a mapping of keys, not {describe_value(data)}")
    return data


def _file_error(path: Path, what: str) -> ConfigError:
    problem = f"{path}: {what}"
    return ConfigError(f"invalid configuration: {problem}", problems=[problem])


def _apply_environment(data: dict[str, Any], environ: Mapping[str, str]) -> dict[tuple[str, ...], str]:
    """Merge ``EDGE_AGENT__A__B=value`` into ``data``; return which key path each variable set.

    Shallow variables are applied before deeper ones, so ``EDGE_AGENT__MQTT__PORT`` refines what
    ``EDGE_AGENT__MQTT`` set. Keys are matched case-insensitively against keys already in the file.
    """
    variables = sorted(
        (name for name in environ if name.startswith(ENV_PREFIX)),
        key=lambda name: (name.count(ENV_SEPARATOR), name),
    )
    applied: dict[tuple[str, ...], str] = {}
    problems: list[str] = []
    for name in variables:
        segments = [s.lower() for s in name[len(ENV_PREFIX) :].split(ENV_SEPARATOR)]
        if not all(segments):
            problems.append(f"{name}: empty key level; write EDGE_AGENT__SECTION__KEY=value")
            continue
        node: dict[str, Any] = data
        keys: list[str] = []
        for i, segment in enumerate(segments):
            key = _match_key(node, segment)
            keys.append(key)
            if i == len(segments) - 1:
                node[key] = _parse_env_value(environ[name])
                applied[tuple(keys)] = name
                break
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                problems.append(f"{name}: cannot set a key below {'.'.join(keys)}, which is not a mapping")
                break
            node = child
    if problems:
        problems.sort()
        raise ConfigError("invalid configuration environment: " + "; ".join(problems), problems=problems)
    return applied


def _match_key(node: dict[str, Any], segment: str) -> str:
    if segment in node:
        return segment
    matches = [k for k in node if isinstance(k, str) and k.lower() == segment]
    return matches[0] if len(matches) == 1 else segment


def _parse_env_value(value: str) -> Any:
    """Parse an override as YAML (numbers, booleans, null, ``[a, b]``); invalid YAML stays a string."""
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError:
        return value


def _section(data: Any, key: str) -> dict[Any, Any]:
    value = data.get(key) if isinstance(data, dict) else None
    return value if isinstance(value, dict) else {}


def _missing_files(data: dict[str, Any], directory: Path, *, require_models: bool = True) -> list[Problem]:
    """Files the agent reads at start must exist; a file source's video need not (it may appear later)."""
    wanted: list[tuple[tuple[str | int, ...], Any]] = []
    for name, slot in _section(data, "slots").items():
        if isinstance(slot, dict):
            if require_models:
                wanted.append((("slots", name, "model"), slot.get("model")))
            labels = _section(slot, "postprocess").get("labels_file")
            wanted.append((("slots", name, "postprocess", "labels_file"), labels))
    mqtt = _section(data, "mqtt")
    wanted.append((("mqtt", "password_file"), mqtt.get("password_file")))
    tls = _section(mqtt, "tls")
    # With an enrollment: section the device makes its key and receives its certificate itself.
    enrollment = _section(data, "enrollment")
    own = ("cert_file", "key_file") if enrollment else ()
    wanted.extend(
        (("mqtt", "tls", key), tls.get(key)) for key in ("ca_file", "cert_file", "key_file") if key not in own
    )
    wanted.extend((("enrollment", key), enrollment.get(key)) for key in ("claim_cert_file", "claim_key_file"))

    problems = []
    for loc, value in wanted:
        if not isinstance(value, str) or not value:
            continue
        file = directory / value  # already absolute unless the surrounding section was invalid
        if not file.exists():
            problems.append(Problem(loc, f"file not found: {file}"))
        elif not file.is_file():
            problems.append(Problem(loc, f"not a regular file: {file}"))
    return problems


def _unknown_slots(data: dict[str, Any]) -> list[Problem]:
    # AgentConfig's own validator makes this check too, but pydantic only runs it when every field
    # is valid and stops at the first stream; checking here reports all of them, always.
    slots = _section(data, "slots")
    problems = []
    for name, stream in _section(data, "streams").items():
        slot = stream.get("slot") if isinstance(stream, dict) else None
        if isinstance(slot, str) and slot not in slots:
            problems.append(Problem(("streams", name, "slot"), unknown_slot_what(slot, slots)))
    return problems
