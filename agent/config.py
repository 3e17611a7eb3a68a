"""The agent's configuration: pydantic models, loaded from YAML with environment overrides.

Loading (:func:`load_config`, :func:`check_config`, :func:`read_secret`) is implemented below the
models; docs/configuration.md describes the file for operators.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable, Mapping
from datetime import date
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, TypeGuard, Union, get_args, get_origin

import structlog
import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from agent.camera.preprocess_spec import PreprocessSpec
from agent.camera.source_spec import SourceSpec
from agent.delivery.settings import DeliveryConfig
from agent.engines.settings import EngineConfig
from agent.engines.spec import BuildSpec
from agent.errors import ConfigError
from agent.model_base import StrictModel
from agent.mqtt.settings import MqttSettings
from agent.postprocess.spec import ClassificationSpec, PostprocessSpec
from agent.spool_settings import SpoolSettings

_log = structlog.get_logger(__name__)

#: Device ids, slot and stream names become MQTT topic levels and file names.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
Name = Annotated[str, Field(pattern=NAME_PATTERN.pattern)]


class SlotConfig(StrictModel):
    """A model slot: one model at a time, hot-swappable, shared by any number of streams."""

    model: Path = Field(description="ONNX model file (relative paths are from the config file).")
    model_id: str | None = Field(None, description="Name reported with results; default: the file stem.")
    version: str | None = Field(None, description="Version reported with results.")
    backend: str = Field("onnxruntime", description="Inference backend key.")
    providers: list[str] = Field(
        default_factory=lambda: ["CPUExecutionProvider"],
        description="ONNX Runtime providers in order of preference; missing ones are skipped.",
    )
    intra_op_threads: int = Field(
        0,
        ge=0,
        description="ONNX Runtime threads per inference; 0 = auto: the cores divided by the slot's "
        "inference workers, ORT's default for one worker, and 1 for a model that runs in under 1.5 ms "
        "per frame on the CPU (the other cores decode frames).",
    )
    allow_spinning: bool = Field(
        False,
        description="ONNX Runtime worker threads busy-wait between runs: lower latency on an idle "
        "many-core device, wasted CPU otherwise.",
    )
    max_batch: int = Field(
        4, ge=1, le=64, description="Most frames run in one batch when streams share a slot."
    )
    inference_workers: int = Field(
        0,
        ge=0,
        le=8,
        description="Inference threads running batches side by side; results are still published in "
        "the order frames were taken. 0 = auto: one single-threaded run per core (at most 4) for a "
        "CPU-only slot fed only by unpaced files (throughput), else 1 run over every core (latency).",
    )
    preprocess: PreprocessSpec = Field(default_factory=PreprocessSpec)
    postprocess: PostprocessSpec = Field(default_factory=ClassificationSpec)
    build: BuildSpec | None = Field(
        None, description="Engine build request; absent: run the ONNX model as it is on ONNX Runtime."
    )


class StreamConfig(StrictModel):
    """A camera stream feeding one slot."""

    source: SourceSpec
    slot: Name = Field(description="Slot (key of ``slots``) whose model processes this stream.")
    fps_limit: float | None = Field(None, gt=0, description="Process at most this many frames per second.")
    drop_policy: Literal["auto", "keep_newest", "process_all"] = Field(
        "auto",
        description="When inference falls behind: keep_newest drops old frames (live cameras), "
        "process_all blocks capture (files). auto picks by source type.",
    )
    queue_size: int = Field(4, ge=1, le=1024, description="Frames buffered between capture and inference.")
    results_qos: Literal[0, 1] = Field(0, description="MQTT QoS of result messages.")
    durable_results: bool = Field(False, description="Spool results to disk so none is lost (implies QoS 1).")


class TelemetryConfig(StrictModel):
    """Periodic telemetry on ``up/telemetry``."""

    interval_s: float = Field(10.0, gt=0, description="Seconds between telemetry messages.")
    sysfs_root: Path = Field(
        Path("/"), description="Root for /sys and /proc reads (tests point it elsewhere)."
    )


class LoggingConfig(StrictModel):
    """structlog output."""

    format: Literal["json", "console"] = Field("json", description="json for journald, console for humans.")
    level: Literal["debug", "info", "warning", "error"] = Field("info", description="Lowest level logged.")


class AgentConfig(StrictModel):
    """The whole configuration file."""

    device_id: Name = Field(description="Device id: MQTT client id, topic level and certificate CN.")
    state_dir: Path = Field(Path("/var/lib/edge-agent"), description="Models, engines, state.json, spool.")
    mqtt: MqttSettings = Field(default_factory=MqttSettings)
    slots: dict[Name, SlotConfig] = Field(default_factory=dict)
    streams: dict[Name, StreamConfig] = Field(default_factory=dict)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    delivery: DeliveryConfig = Field(default_factory=DeliveryConfig)
    engines: EngineConfig = Field(default_factory=EngineConfig)
    spool: SpoolSettings = Field(default_factory=SpoolSettings)

    @model_validator(mode="after")
    def _streams_name_known_slots(self) -> AgentConfig:
        for name, stream in self.streams.items():
            if stream.slot not in self.slots:
                raise ValueError(_unknown_slot_message(name, stream.slot, self.slots))
        return self


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

#: Environment variables with this prefix override configuration keys, e.g.
#: ``EDGE_AGENT__MQTT__PORT=1884`` sets ``mqtt.port``.
ENV_PREFIX = "EDGE_AGENT__"
ENV_SEPARATOR = "__"


def load_config(
    path: Path, environ: Mapping[str, str] | None = None, *, require_models: bool = True
) -> AgentConfig:
    """Load and validate the configuration file at ``path``, applying environment overrides.

    ``environ`` defaults to ``os.environ``; only ``EDGE_AGENT__*`` variables are used. Relative paths
    are resolved against the directory of ``path``. Files the agent needs at start (slot models,
    label files, the MQTT password file, TLS files) must exist. Every problem found is reported in
    one :class:`~agent.errors.ConfigError` whose ``problems`` read ``key.path: what is wrong``.

    The daemon passes ``require_models=False``: a missing model file must not keep a device from
    starting (it falls back to the last model that worked, from ``state.json``) nor make a reload
    fail as a whole (that slot's swap is rejected and the old model keeps serving).
    """
    path = Path(path)
    data = _read_yaml(path)
    env_keys = _apply_environment(data, os.environ if environ is None else environ)
    _drop_empty_sections(data, AgentConfig)
    base_dir = path.absolute().parent
    data = _resolve_paths(data, AgentConfig, base_dir)

    problems: list[_Problem] = []
    config: AgentConfig | None = None
    try:
        config = AgentConfig.model_validate(data)
    except ValidationError as exc:
        problems.extend(_describe(error) for error in exc.errors())
    problems.extend(_missing_files(data, base_dir, require_models=require_models))
    problems.extend(_unknown_slots(data))
    if problems or config is None:
        raise _config_error(path, problems, env_keys)
    return config


def check_config(path: Path, environ: Mapping[str, str] | None = None) -> list[str]:
    """Return every problem in the configuration at ``path`` (an empty list when it is valid)."""
    try:
        load_config(path, environ)
    except ConfigError as exc:
        return list(exc.problems)
    return []


def read_secret(path: Path) -> str:
    """Return the secret stored in the file at ``path``, without its trailing newline.

    Logs ``config.secret.readable`` (a warning) when the file is readable by group or others.
    """
    path = Path(path)
    try:
        mode = path.stat().st_mode
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(
            f"cannot read secret file {path}: {reason}; check that it exists and the agent may read it"
        ) from exc
    if mode & 0o044:
        _log.warning(
            "config.secret.readable",
            path=str(path),
            mode=oct(mode & 0o777),
            hint=f"restrict it with: chmod 600 {path}",
        )
    if text.endswith("\r\n"):
        text = text[:-2]
    elif text.endswith("\n"):
        text = text[:-1]
    if not text:
        raise ConfigError(f"secret file {path} is empty; write the secret into it")
    return text


# --- reading and merging ------------------------------------------------------------------


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


def _read_yaml(path: Path) -> dict[str, Any]:
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
    if data is None:
        raise _file_error(path, "the file is empty; it must be a mapping with at least device_id")
    if not isinstance(data, dict):
        raise _file_error(path, f"the top level must be a mapping of keys, not {_describe_value(data)}")
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


# --- walking the models -------------------------------------------------------------------


def _unwrap(tp: Any) -> tuple[Any, str | None]:
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


def _field_type(model: type[BaseModel], key: Any) -> tuple[Any, str | None] | None:
    field = model.model_fields.get(key) if isinstance(key, str) else None
    if field is None:
        return None
    tp, discriminator = _unwrap(field.annotation)
    if isinstance(field.discriminator, str):
        discriminator = field.discriminator
    return tp, discriminator


def _is_model(tp: Any) -> TypeGuard[type[BaseModel]]:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _union_members(tp: Any, discriminator: str) -> dict[Any, type[BaseModel]]:
    """Map each tag value of a discriminated union to its member model."""
    members: dict[Any, type[BaseModel]] = {}
    for member in get_args(tp):
        if _is_model(member) and discriminator in member.model_fields:
            for tag in get_args(member.model_fields[discriminator].annotation):
                members[tag] = member
    return members


def _descend(tp: Any, discriminator: str | None, value: Any) -> Any:
    """The model type a raw ``value`` of annotation ``tp`` validates as (picks union members)."""
    if discriminator and isinstance(value, dict):
        return _union_members(tp, discriminator).get(value.get(discriminator))
    return tp


def _drop_empty_sections(data: dict[str, Any], model: type[BaseModel]) -> None:
    """Treat ``section:`` with nothing below it (YAML null) as absent, so its defaults apply."""
    for key in list(data):
        found = _field_type(model, key)
        if found is None:
            continue
        tp, _ = found
        field = model.model_fields[key]
        value = data[key]
        if value is None and not field.is_required() and not _admits_none(field.annotation):
            del data[key]
        elif _is_model(tp) and isinstance(value, dict):
            _drop_empty_sections(value, tp)
        elif get_origin(tp) is dict and isinstance(value, dict):
            item_tp, _ = _unwrap(get_args(tp)[1])
            for item in value.values():
                if _is_model(item_tp) and isinstance(item, dict):
                    _drop_empty_sections(item, item_tp)


def _admits_none(annotation: Any) -> bool:
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return get_origin(annotation) in (Union, UnionType) and type(None) in get_args(annotation)


def _resolve_paths(value: Any, tp: Any, base_dir: Path, discriminator: str | None = None) -> Any:
    """Return raw ``value`` with every relative string in a ``Path`` field made absolute."""
    tp = _descend(tp, discriminator, value)
    if tp is Path:
        if isinstance(value, str) and value and not Path(value).is_absolute():
            return str(base_dir / value)
        return value
    if _is_model(tp) and isinstance(value, dict):
        out = {}
        for key, item in value.items():
            found = _field_type(tp, key)
            out[key] = item if found is None else _resolve_paths(item, found[0], base_dir, found[1])
        return out
    if get_origin(tp) is dict and isinstance(value, dict):
        item_tp, item_disc = _unwrap(get_args(tp)[1])
        return {k: _resolve_paths(v, item_tp, base_dir, item_disc) for k, v in value.items()}
    if get_origin(tp) is list and isinstance(value, list):
        item_tp, item_disc = _unwrap(get_args(tp)[0])
        return [_resolve_paths(v, item_tp, base_dir, item_disc) for v in value]
    return value


# --- checks pydantic cannot make ----------------------------------------------------------


class _Problem:
    """One problem: the key path (tuple of keys and list indexes) and what is wrong there."""

    __slots__ = ("loc", "what")

    def __init__(self, loc: tuple[str | int, ...], what: str) -> None:
        self.loc = loc
        self.what = what

    def render(self) -> str:
        if not self.loc:
            return self.what
        path = ""
        for part in self.loc:
            path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
        return f"{path}: {self.what}"


def _section(data: Any, key: str) -> dict[Any, Any]:
    value = data.get(key) if isinstance(data, dict) else None
    return value if isinstance(value, dict) else {}


def _missing_files(data: dict[str, Any], base_dir: Path, *, require_models: bool = True) -> list[_Problem]:
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
    wanted.extend((("mqtt", "tls", key), tls.get(key)) for key in ("ca_file", "cert_file", "key_file"))

    problems = []
    for loc, value in wanted:
        if not isinstance(value, str) or not value:
            continue
        file = base_dir / value  # already absolute unless the surrounding section was invalid
        if not file.exists():
            problems.append(_Problem(loc, f"file not found: {file}"))
        elif not file.is_file():
            problems.append(_Problem(loc, f"not a regular file: {file}"))
    return problems


def _unknown_slots(data: dict[str, Any]) -> list[_Problem]:
    # AgentConfig's own validator makes this check too, but pydantic only runs it when every field
    # is valid and stops at the first stream; checking here reports all of them, always.
    slots = _section(data, "slots")
    problems = []
    for name, stream in _section(data, "streams").items():
        slot = stream.get("slot") if isinstance(stream, dict) else None
        if isinstance(slot, str) and slot not in slots:
            problems.append(_Problem(("streams", name, "slot"), _unknown_slot_what(slot, slots)))
    return problems


def _unknown_slot_what(slot: str, slots: Iterable[Any]) -> str:
    known = ", ".join(sorted(str(s) for s in slots)) or "none"
    return f"no slot named {slot!r} (slots: {known})"


def _unknown_slot_message(stream: str, slot: str, slots: Iterable[Any]) -> str:
    return f"streams.{stream}.slot: {_unknown_slot_what(slot, slots)}"


# --- turning pydantic errors into operator messages ---------------------------------------


def _clean_loc(loc: tuple[str | int, ...]) -> tuple[tuple[str | int, ...], list[Any]]:
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
            member = _union_members(tp, disc).get(seg)
            if member is not None:  # a union tag level: not a key the operator wrote
                tp, disc = member, None
                types[-1] = member
                i += 1
                continue
        path.append(seg)
        if _is_model(tp):
            found = _field_type(tp, seg)
            tp, disc = found if found is not None else (None, None)
        elif get_origin(tp) is dict:
            tp, disc = _unwrap(get_args(tp)[1])
        elif get_origin(tp) in (list, tuple) and isinstance(seg, int):
            args = [a for a in get_args(tp) if a is not Ellipsis]
            item = args[seg] if get_origin(tp) is tuple and seg < len(args) else args[0] if args else None
            tp, disc = _unwrap(item)
        else:
            tp, disc = None, None
        types.append(tp)
        i += 1
    return tuple(path), types


def _describe(error: ErrorDetails) -> _Problem:
    """Phrase one pydantic error for an operator, at the key path the operator wrote."""
    loc, types = _clean_loc(tuple(error["loc"]))
    kind = error["type"]
    ctx: dict[str, Any] = dict(error.get("ctx") or {})
    value = error.get("input")
    here = types[-1]

    if kind in ("union_tag_invalid", "union_tag_not_found"):
        disc = str(ctx.get("discriminator", "type")).strip("'")
        tags = ", ".join(str(t) for t in _union_members(here, disc)) or ctx.get("expected_tags", "")
        if kind == "union_tag_not_found":
            return _Problem((*loc, disc), f"required key is missing (one of {tags})")
        return _Problem((*loc, disc), f"{ctx.get('tag')!r} is not one of {tags}")
    if kind == "missing" and len(loc) >= 2 and get_origin(types[-2]) is tuple:
        size = len(get_args(types[-2]))  # pydantic reports each absent tuple item separately
        return _Problem(loc[:-1], f"must be a list of {size} values")
    if kind == "literal_error":
        choices = get_args(here) if get_origin(here) is Literal else ()
        allowed = ", ".join(str(c) for c in choices) if choices else str(ctx.get("expected"))
        return _Problem(loc, f"{value!r} is not one of {allowed}")
    if kind == "extra_forbidden":
        parent = types[-2] if len(types) >= 2 else None
        what = "unknown key"
        if _is_model(parent):
            close = difflib.get_close_matches(str(loc[-1]), list(parent.model_fields), n=1)
            if close:
                what += f" (did you mean {close[0]!r}?)"
            else:
                what += f" (allowed: {', '.join(parent.model_fields)})"
        return _Problem(loc, what)
    if kind == "string_pattern_mismatch" and ctx.get("pattern") == NAME_PATTERN.pattern:
        return _Problem(
            loc,
            f"{value!r} is not a valid name: use 1-64 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit",
        )
    if kind == "value_error" and isinstance(ctx.get("error"), Exception):
        return _Problem(loc, str(ctx["error"]))
    if value is None and kind not in ("missing",) and kind.endswith("_type"):
        return _Problem(loc, "must have a value (it is empty)")
    template = _MESSAGES.get(kind)
    if template is not None:
        what = template.format(value=_describe_value(value), **ctx)
        if kind == "string_type" and isinstance(value, (int, float, bool, date)):
            what += " (put it in quotes)"
        return _Problem(loc, what)
    return _Problem(loc, error["msg"].replace("Input should be", "must be"))


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


def _describe_value(value: Any) -> str:
    if value is None:
        return "empty"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return repr(value) if not isinstance(value, date) else repr(str(value))


def _config_error(path: Path, problems: list[_Problem], env_keys: dict[tuple[str, ...], str]) -> ConfigError:
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
