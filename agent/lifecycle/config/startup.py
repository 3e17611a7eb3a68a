"""The configuration the agent runs: its own agent.yaml with the overlay the record names, at every start.

:func:`starting_config` is what ``edge-agent run`` loads. A change that is still pending when the
agent starts counts that start; a pending overlay the agent cannot load, or one it started with
:data:`MAX_PENDING_STARTS` times without the change being confirmed (a crash loop under systemd's
``Restart=on-failure``), is put back by itself: the record's ``active`` becomes the last good overlay
and ``reverted`` says why, which the resumed job reports as ``config_reverted``.
"""

from __future__ import annotations

from pathlib import Path

import structlog

from agent.config import AgentConfig, load_config
from agent.errors import ConfigError
from agent.lifecycle.config.record import ConfigRecord, OverlayFiles, OverlayRef, Reverted

log = structlog.get_logger(__name__)

#: Starts with a change pending after which it is put back (the agent did not stay up with it).
MAX_PENDING_STARTS = 3
#: Longest reason kept (TargetInfo.reverted and the job's error are bounded).
MAX_REASON = 300


def current_config(config_path: Path, *, require_models: bool = False) -> AgentConfig:
    """agent.yaml with the record's active overlay (what a reload applies); ConfigError if invalid."""
    base = load_config(config_path, require_models=require_models)
    files = OverlayFiles(base.state_dir)
    record = files.read()
    if record.active is None:
        return base
    return _with_overlay(config_path, files, record.active, require_models=require_models)


def starting_config(config_path: Path) -> AgentConfig:
    """What ``edge-agent run`` starts with: agent.yaml and the active overlay, or the last good one.

    The base file must load (ConfigError otherwise, as before overlays existed); an overlay that does
    not load over it is logged and replaced by the last good one, then by none.
    """
    base = load_config(config_path, require_models=False)
    files = OverlayFiles(base.state_dir)
    record = files.read()
    pending = record.pending
    if pending is not None:
        starts = pending.starts + 1
        record = record.model_copy(update={"pending": pending.model_copy(update={"starts": starts})})
        if starts > MAX_PENDING_STARTS:
            record = put_back(
                record,
                f"the agent started {pending.starts} times with overlay {pending.overlay.version} "
                "without staying up through its probation",
            )
        files.write(record)
    if record.active is None:
        return base
    try:
        return _with_overlay(config_path, files, record.active, require_models=False)
    except ConfigError as exc:
        problems = "; ".join(exc.problems) or str(exc)
        log.error("config.overlay.unloadable", version=record.active.version, problems=problems)
        if pending is not None and record.pending is not None:
            record = put_back(
                record, f"the agent could not start with overlay {record.active.version}: {problems}"
            )
            files.write(record)
            if record.active is not None:
                try:
                    return _with_overlay(config_path, files, record.active, require_models=False)
                except ConfigError as again:
                    log.error("config.overlay.last_good_unloadable", error=str(again))
        return base


def put_back(record: ConfigRecord, reason: str) -> ConfigRecord:
    """``record`` with its pending change put back: the last good overlay active, and why."""
    assert record.pending is not None
    tried = record.pending.overlay
    return record.model_copy(
        update={
            "active": record.last_good,
            "pending": None,
            "reverted": Reverted(job_id=tried.job_id, version=tried.version, reason=bounded(reason)),
        }
    )


def bounded(reason: str) -> str:
    return reason if len(reason) <= MAX_REASON else reason[: MAX_REASON - 3] + "..."


def _with_overlay(
    config_path: Path, files: OverlayFiles, ref: OverlayRef, *, require_models: bool
) -> AgentConfig:
    return load_config(config_path, require_models=require_models, overlay=files.load_overlay(ref))
